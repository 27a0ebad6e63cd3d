"""The committed generated code is what its recipe generates now: the protocol's from the
.proto (scripts/gen_protos.py), the blocking client from the asyncio one
(scripts/gen_sync_client.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
# Every generated file, by its path below protos/: tokembed.v1, and the Open Inference
# Protocol (Triton's grpc_service.proto and model_config.proto, as tokembed.v2).
GENERATED_FILES = [
    f"tokembed/{folder}/{stem}{suffix}"
    for folder, stem in [
        ("v1", "embedding"),
        ("v2", "grpc_service"),
        ("v2", "model_config"),
    ]
    for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
]


def load_recipe(name: str = "gen_protos") -> ModuleType:
    path = ROOT / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"tokembed_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("protos")
    load_recipe().generate(out)
    return out


@pytest.mark.parametrize("name", GENERATED_FILES)
def test_committed_generated_file_is_up_to_date(regenerated: Path, name: str) -> None:
    fresh = regenerated / name
    assert fresh.is_file(), f"the recipe no longer writes {name}"
    committed = PROTOS / name
    assert committed.is_file(), f"{name} is not committed beside the .proto"
    assert committed.read_bytes() == fresh.read_bytes(), (
        f"protos/{name} is stale: run `python scripts/gen_protos.py` and commit"
    )


def test_recipe_writes_nothing_unexpected(regenerated: Path) -> None:
    # A new generated file (say, another .proto) must be committed and checked here too.
    written = sorted(str(p.relative_to(regenerated)) for p in regenerated.rglob("*") if p.is_file())
    assert written == sorted(GENERATED_FILES)


def _lower_bound(name: str) -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"]:
        match = re.fullmatch(rf"{name}>=([0-9.]+)(,.*)?", requirement)
        if match:
            return match[1]
    raise AssertionError(f"pyproject.toml states no lower bound for {name}")


@pytest.mark.parametrize("name", [n for n in GENERATED_FILES if n.endswith(".py")])
def test_lower_bounds_are_what_the_generated_code_needs(name: str) -> None:
    """protobuf refuses code from a newer protoc than itself, the gRPC stubs a grpcio older
    than the grpcio-tools that made them: the lower bounds in pyproject.toml are exactly
    those versions (tests/e2e/test_lowest_protobuf.py runs on them), no higher (tokembed
    installs beside libraries that cap protobuf below 7) and no lower (it would not load)."""
    text = (PROTOS / name).read_text()
    if name.endswith("_pb2.py"):
        made_by = re.search(r"# Protobuf Python Version: ([0-9.]+)", text)
        assert made_by and made_by[1] == _lower_bound("protobuf"), name
    else:
        made_by = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", text)
        assert made_by and made_by[1] == _lower_bound("grpcio"), name


# --- the blocking client, generated from the asyncio one

CLIENT = ROOT / "client"


@pytest.fixture(scope="module")
def regenerated_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("client")
    load_recipe("gen_sync_client").generate(out)
    return out


def test_the_recipe_writes_each_blocking_twin_and_nothing_else(regenerated_client: Path) -> None:
    written = sorted(p.name for p in regenerated_client.iterdir())
    assert written == sorted(load_recipe("gen_sync_client").SOURCES.values())


@pytest.mark.parametrize("name", ["sync.py", "shared_memory.py"])
def test_committed_blocking_client_is_up_to_date(regenerated_client: Path, name: str) -> None:
    committed = CLIENT / name
    assert committed.read_text().startswith("# Generated from client/"), name
    assert committed.read_bytes() == (regenerated_client / name).read_bytes(), (
        f"client/{name} is stale: run `python scripts/gen_sync_client.py` and commit"
    )
