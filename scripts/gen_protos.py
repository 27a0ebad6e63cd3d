"""Regenerate the protocol's Python code beside the .proto (or into another folder).

The one recipe for generated code: `python scripts/gen_protos.py`. It writes
`*_pb2.py`, `*_pb2_grpc.py` and their `.pyi` type stubs (mypy-protobuf) for every
protocol: tokembed.v1 and the Open Inference Protocol (`tokembed/v2`, Triton's
grpc_service.proto and model_config.proto). tests/test_generated_code.py runs it into a
temporary folder and fails if the committed files differ.

Run it with the grpcio-tools that the dev extra pins: the protoc inside it decides the
lowest protobuf runtime that can load the code (pyproject.toml says which, and why).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_FILES = [
    "tokembed/v1/embedding.proto",
    "tokembed/v2/model_config.proto",
    "tokembed/v2/grpc_service.proto",
]


def generate(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    plugin = shutil.which("protoc-gen-mypy", path=str(Path(sys.executable).parent))
    grpc_plugin = shutil.which("protoc-gen-mypy_grpc", path=str(Path(sys.executable).parent))
    if plugin is None or grpc_plugin is None:
        raise SystemExit("mypy-protobuf is not installed (pip install -e '.[dev]')")
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--plugin=protoc-gen-mypy={plugin}",
        f"--plugin=protoc-gen-mypy_grpc={grpc_plugin}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="default: beside the .proto")
    generate(parser.parse_args().out)
