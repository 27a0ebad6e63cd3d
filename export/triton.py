"""``tokembed export-triton MODEL_DIR OUT``: a Triton model repository for a model directory.

Triton Inference Server's onnxruntime backend serves the same ``model.onnx`` tokembed
serves, from a repository laid out as

    OUT/<name>/config.pbtxt
    OUT/<name>/<version>/model.onnx        (and its external data, beside it)

``config.pbtxt`` declares the backend, the inputs and the output with Triton's datatypes
and dims (the batch dimension implicit: ``max_batch_size`` > 0), the instance group (CPU or
GPU) and dynamic batching (requests of the same sequence length are batched, waiting at
most ``max_queue_delay_microseconds``). The model directory is checked as the server checks
it (every file's sha256 too) before anything is copied; the repository entry is written
beside its destination and moved in whole. Needs neither torch nor Triton: the graph is
checked with onnx, which tokembed[server] brings.

What is checked here (tests/export/test_export_triton.py): config.pbtxt parses with
Triton's own ``ModelConfig`` message (tritonclient ships it) and says what is written
above; the copied ``model.onnx`` answers through onnxruntime exactly as the model
directory's does. Triton itself cannot be started in this project's environment (no
image, no network to fetch one), so a run under Triton is the one step not shown here.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokembed.export.dtypes import ROWS
from tokembed.export.errors import ExportError, ModelDirError
from tokembed.export.manifest import MANIFEST_NAME

if TYPE_CHECKING:
    from tokembed.export.model_dir import ModelDir

CONFIG_NAME = "config.pbtxt"
# The manifest's dtype names -> Triton's (model_config.proto, DataType).
INSTANCE_KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU"}


@dataclass(frozen=True)
class TritonOptions:
    instance_kind: str = "cpu"  # cpu or gpu
    instances: int = 1
    max_batch_size: int = 64
    max_queue_delay_us: int = 2000
    # onnxruntime's intra-op threads per instance (CPU): 1, as tokembed serve runs it (a
    # gather is memory-bound; docs/deployment.md). 0 leaves onnxruntime's default.
    intra_op_threads: int = 1
    version: int | None = None  # None: the manifest's version, which must then be a number
    name: str | None = None  # None: the manifest's name
    force: bool = False


def export_triton(model_dir: Path, out: Path, options: TritonOptions) -> Path:
    """Write the repository entry for ``model_dir`` into ``out``; return its version
    directory (``OUT/<name>/<version>``)."""
    from tokembed.export.model_dir import load_model_dir
    from tokembed.export.staging import make_staging_dir, publish_new

    _check_options(options)
    try:
        model = load_model_dir(model_dir)
    except ModelDirError as exc:
        raise ExportError(str(exc)) from exc
    manifest = model.manifest
    name = options.name if options.name is not None else manifest.name
    if not name or "/" in name or name in (".", ".."):
        raise ExportError(f"model name {name!r} cannot name a directory; pass --name")
    version = options.version if options.version is not None else _version_of(manifest.version)
    destination = out / name
    if destination.exists() and not options.force:
        raise ExportError(f"{destination} exists; pass --force to replace it")
    staging = make_staging_dir(destination, label=str(destination))
    try:
        version_dir = staging / str(version)
        version_dir.mkdir()
        for file_name in manifest.files:
            shutil.copy2(model.path / file_name, version_dir / file_name)
        # Where the model came from, beside its config (Triton reads only the config and
        # the numbered directories).
        shutil.copy2(model.path / MANIFEST_NAME, staging / "tokembed-manifest.json")
        config = config_pbtxt(model, name, version, options)
        (staging / CONFIG_NAME).write_text(config, encoding="utf-8")
        if destination.exists():
            shutil.rmtree(destination)
        if not publish_new(staging, destination):
            raise ExportError(f"{destination} appeared while it was written; try again")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return destination / str(version)


def config_pbtxt(model: ModelDir, name: str, version: int, options: TritonOptions) -> str:
    """The model's ``config.pbtxt`` (protobuf text format of Triton's ``ModelConfig``)."""
    manifest = model.manifest
    inputs = []
    for spec in model.kind.inputs(manifest):
        dtype = manifest.input.dtype if spec.name == manifest.input.name else "int64"
        lines = [
            f"    name: {json.dumps(spec.name)}",
            f"    data_type: {_triton_dtype(dtype)}",
            "    dims: [ -1 ]",
        ]
        if spec.optional:
            lines.append("    optional: true")
        inputs.append("  {\n" + "\n".join(lines) + "\n  }")
    output = (
        "  {\n"
        f"    name: {json.dumps(manifest.output.name)}\n"
        f"    data_type: {_triton_dtype(manifest.output.dtype)}\n"
        f"    dims: [ -1, {manifest.d_model} ]\n"
        "  }"
    )
    parts = [
        f"# Written by tokembed export-triton from {manifest.name} v{manifest.version} "
        f"(model.onnx sha256 {model.model_sha256}).",
        f"name: {json.dumps(name)}",
        'backend: "onnxruntime"',
        f"max_batch_size: {options.max_batch_size}",
        "input [\n" + ",\n".join(inputs) + "\n]",
        "output [\n" + output + "\n]",
        "instance_group [\n  {\n"
        f"    count: {options.instances}\n"
        f"    kind: {INSTANCE_KINDS[options.instance_kind]}\n"
        "  }\n]",
        f"dynamic_batching {{\n  max_queue_delay_microseconds: {options.max_queue_delay_us}\n}}",
        f"version_policy: {{ specific: {{ versions: [ {version} ] }} }}",
    ]
    if options.intra_op_threads > 0:
        parts.append(
            "parameters {\n"
            '  key: "intra_op_thread_count"\n'
            f'  value: {{ string_value: "{options.intra_op_threads}" }}\n'
            "}"
        )
    return "\n".join(parts) + "\n"


def _version_of(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise ExportError(
            f"the model's version {text!r} is not a positive integer, which Triton's "
            "version directories must be; pass --version N"
        )
    return int(text)


def _triton_dtype(name: str) -> str:
    dtype = ROWS.get(name)
    if dtype is None:
        raise ExportError(f"dtype {name} has no Triton datatype here")
    return dtype.triton


def _check_options(options: TritonOptions) -> None:
    if options.instance_kind not in INSTANCE_KINDS:
        raise ExportError(f"--instance-kind must be cpu or gpu, got {options.instance_kind!r}")
    for flag, value, low in (
        ("--instances", options.instances, 1),
        ("--max-batch-size", options.max_batch_size, 1),
        ("--max-queue-delay-us", options.max_queue_delay_us, 0),
        ("--intra-op-threads", options.intra_op_threads, 0),
    ):
        if value < low:
            raise ExportError(f"{flag} must be at least {low}, got {value}")
    if options.version is not None and options.version <= 0:
        raise ExportError(f"--version must be a positive integer, got {options.version}")


# --- the command line


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "export-triton",
        help="write a Triton model repository entry (onnxruntime backend) for a model directory",
        description=(
            "Write OUT/<name>/config.pbtxt and OUT/<name>/<version>/model.onnx (with its "
            "external data) for Triton Inference Server's onnxruntime backend, from a "
            "tokembed model directory (checked first, sha256 included). OUT may hold other "
            "models already."
        ),
    )
    parser.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="model directory")
    parser.add_argument("out", type=Path, metavar="OUT", help="model repository to write into")
    defaults = TritonOptions()
    parser.add_argument("--instance-kind", choices=sorted(INSTANCE_KINDS),
                        default=defaults.instance_kind,
                        help="where each model instance runs (default cpu)")  # fmt: skip
    parser.add_argument("--instances", type=int, default=defaults.instances,
                        help="model instances (default 1)")  # fmt: skip
    parser.add_argument(
        "--max-batch-size", type=int, default=defaults.max_batch_size,
        help=f"sequences per batch (default {defaults.max_batch_size})",
    )  # fmt: skip
    parser.add_argument(
        "--max-queue-delay-us", type=int, default=defaults.max_queue_delay_us,
        help=f"how long a request may wait for company, in microseconds (default "
        f"{defaults.max_queue_delay_us}, tokembed serve's --max-delay-ms 2)",
    )  # fmt: skip
    parser.add_argument(
        "--intra-op-threads", type=int, default=defaults.intra_op_threads,
        help="onnxruntime intra-op threads per instance (default 1; 0: onnxruntime's default)",
    )  # fmt: skip
    parser.add_argument("--version", type=int, default=None,
                        help="version directory (default: the manifest's version)")  # fmt: skip
    parser.add_argument("--name", default=None,
                        help="model name in the repository (default: the manifest's)")  # fmt: skip
    parser.add_argument("--force", action="store_true", help="replace OUT/<name> if it exists")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    options = TritonOptions(
        instance_kind=args.instance_kind, instances=args.instances,
        max_batch_size=args.max_batch_size, max_queue_delay_us=args.max_queue_delay_us,
        intra_op_threads=args.intra_op_threads, version=args.version, name=args.name,
        force=args.force,
    )  # fmt: skip
    version_dir = export_triton(args.model_dir, args.out, options)
    print(f"wrote {version_dir.parent / CONFIG_NAME} and {version_dir}/ for Triton's "
          "onnxruntime backend")  # fmt: skip
    return 0
