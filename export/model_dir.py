"""The model-directory loader: the only way the server opens a model.

It trusts nothing in ``manifest.json`` until it has checked it: every listed file is
present with the recorded size and sha256, the graph's input, output, embedding
table, opset and scale agree with the manifest, and any external data the graph points
to is listed.
Every failure is a ``ModelDirError`` whose message names the file and the field.

Importable without torch: it needs only the ``onnx`` package, and reads the graph
without loading external weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from tokembed.export.dtypes import WEIGHT_DTYPES, of_onnx
from tokembed.export.errors import ModelDirError
from tokembed.export.hashing import sha256_file
from tokembed.export.kinds import ModelKind, kind_of
from tokembed.export.manifest import MANIFEST_NAME, MODEL_NAME, Manifest


@dataclass(frozen=True)
class ModelDir:
    """A model directory that passed every check."""

    path: Path
    manifest: Manifest
    kind: ModelKind

    @property
    def model_path(self) -> Path:
        return self.path / MODEL_NAME

    @property
    def model_sha256(self) -> str:
        return self.manifest.files[MODEL_NAME].sha256

    @property
    def tokenizer_path(self) -> Path | None:
        """The model's ``tokenizer.json`` (checked and hashed with the rest), if it has one."""
        spec = self.manifest.tokenizer
        return None if spec is None else self.path / spec.file

    @property
    def weight_bytes(self) -> int:
        tokenizer = self.manifest.tokenizer
        return sum(
            entry.size_bytes
            for name, entry in self.manifest.files.items()
            if tokenizer is None or name != tokenizer.file
        )


def load_model_dir(path: Path | str, *, verify_hashes: bool = True) -> ModelDir:
    """Validate a model directory and return it; raise ``ModelDirError`` naming what is wrong.

    ``verify_hashes=False`` checks everything but the files' sha256 (which reads every
    byte): what the server checks before it binds its port, to fail at once.
    """
    directory = Path(path)
    if directory.is_file():
        raise ModelDirError(
            f"{directory}: is a file, not a model directory (model.onnx and manifest.json)"
            + _export_hint(directory)
        )
    if not directory.is_dir():
        raise ModelDirError(f"{directory}: model directory does not exist")
    if not (directory / MANIFEST_NAME).is_file():
        checkpoints = sorted(p.name for p in directory.iterdir() if _is_checkpoint(p))
        if checkpoints:
            raise ModelDirError(
                f"{directory}: holds a checkpoint ({', '.join(checkpoints[:3])}) but no "
                f"{MANIFEST_NAME}: it is not a model directory"
                + _export_hint(directory / checkpoints[0])
            )
    manifest = Manifest.read(directory)
    kind = kind_of(manifest, str(directory / "manifest.json"))
    _check_manifest_values(manifest, directory)
    kind.check(manifest, str(directory / "manifest.json"))
    _check_files(manifest, directory, verify_hashes=verify_hashes)
    _check_graph(manifest, kind, directory)
    return ModelDir(path=directory, manifest=manifest, kind=kind)


# Files a model's weights come in, as tokembed export --weights reads them.
_CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def _is_checkpoint(path: Path) -> bool:
    return path.is_file() and path.name.endswith((*_CHECKPOINT_SUFFIXES, ".index.json"))


def _export_hint(path: Path) -> str:
    if not _is_checkpoint(path):
        return ""
    return (
        f"; make one from it with: tokembed export --weights {path} --key "
        "<the embedding's key> --out <model directory>"
    )


def _check_manifest_values(manifest: Manifest, directory: Path) -> None:
    where = directory / "manifest.json"
    if manifest.vocab_size <= 0:
        raise ModelDirError(f"{where}: vocab_size must be positive, got {manifest.vocab_size}")
    if manifest.d_model <= 0:
        raise ModelDirError(f"{where}: d_model must be positive, got {manifest.d_model}")
    if not (math.isfinite(manifest.scale) and manifest.scale > 0):
        raise ModelDirError(f"{where}: scale must be a positive number, got {manifest.scale}")
    if manifest.weight_dtype not in WEIGHT_DTYPES:
        raise ModelDirError(
            f"{where}: weight_dtype {manifest.weight_dtype!r} is not one of {list(WEIGHT_DTYPES)}"
        )
    padding = manifest.padding_idx
    if padding is not None and not 0 <= padding < manifest.vocab_size:
        raise ModelDirError(f"{where}: padding_idx {padding} is outside [0, {manifest.vocab_size})")
    if MODEL_NAME not in manifest.files:
        raise ModelDirError(f"{where}: files does not list {MODEL_NAME}")
    tokenizer = manifest.tokenizer
    if tokenizer is not None:
        if tokenizer.file not in manifest.files:
            raise ModelDirError(
                f"{where}: tokenizer.file {tokenizer.file!r} is not listed in files (every "
                "file of the model is hashed)"
            )
        if not 0 < tokenizer.vocab_size <= manifest.vocab_size:
            raise ModelDirError(
                f"{where}: tokenizer.vocab_size {tokenizer.vocab_size} is outside "
                f"[1, vocab_size {manifest.vocab_size}]: its ids must be rows of the table"
            )
        if tokenizer.max_length is not None and tokenizer.max_length <= 0:
            raise ModelDirError(
                f"{where}: tokenizer.max_length must be positive, got {tokenizer.max_length}"
            )
    # The declared shapes are part of the contract too: clients read them.
    if len(manifest.input.shape) != 2 or not all(isinstance(d, str) for d in manifest.input.shape):
        raise ModelDirError(
            f"{where}: input.shape is {manifest.input.shape}, expected two dynamic dimensions"
        )
    output_shape = manifest.output.shape
    if len(output_shape) != 3 or not all(isinstance(d, str) for d in output_shape[:2]):
        raise ModelDirError(
            f"{where}: output.shape is {output_shape}, expected two dynamic dimensions and D"
        )
    if output_shape[2] != manifest.d_model:
        raise ModelDirError(
            f"{where}: output.shape ends in {output_shape[2]!r}, but d_model is {manifest.d_model}"
        )


def _safe_member(directory: Path, name: str) -> Path:
    """A file named by the manifest or the graph must stay inside the directory."""
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise ModelDirError(f"{directory}: file name {name!r} points outside the model directory")
    return directory.joinpath(*relative.parts)


def _check_files(manifest: Manifest, directory: Path, *, verify_hashes: bool) -> None:
    for name, entry in sorted(manifest.files.items()):
        file_path = _safe_member(directory, name)
        if not file_path.is_file():
            raise ModelDirError(f"{file_path}: listed in the manifest but missing")
        size = file_path.stat().st_size
        if size != entry.size_bytes:
            raise ModelDirError(
                f"{file_path}: size is {size} bytes, the manifest records {entry.size_bytes}"
            )
        if verify_hashes:
            actual = sha256_file(file_path, label=f"verifying {name}")
            if actual != entry.sha256:
                raise ModelDirError(
                    f"{file_path}: sha256 is {actual}, the manifest records {entry.sha256}"
                )


def _check_graph(manifest: Manifest, kind: ModelKind, directory: Path) -> None:
    import onnx  # deferred: only the loader needs it, and it is not light

    model_path = directory / MODEL_NAME
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError, OSError, ValueError...
        raise ModelDirError(f"{model_path}: not a readable ONNX model ({exc})") from exc
    graph = model.graph
    where = f"{model_path}"
    # Messages name the graph file and the manifest field that disagree with it.
    field_of = f"{directory / 'manifest.json'}"

    initializer_names = {init.name for init in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializer_names]
    expected_inputs = [spec.name for spec in kind.inputs(manifest)]
    if [i.name for i in inputs] != expected_inputs:
        raise ModelDirError(
            f"{where}: graph inputs are {[i.name for i in inputs]}, but a {kind.name} model "
            f"with {field_of} input.name {manifest.input.name!r} takes {expected_inputs}"
        )
    for graph_input in inputs:
        _check_value_info(graph_input, manifest.input.dtype, "input.dtype", 2, None, where)
    outputs = list(graph.output)
    if len(outputs) != 1 or outputs[0].name != manifest.output.name:
        raise ModelDirError(
            f"{where}: graph outputs are {[o.name for o in outputs]}, "
            f"but {field_of} output.name is {manifest.output.name!r}"
        )
    _check_value_info(outputs[0], manifest.output.dtype, "output.dtype", 3, manifest.d_model, where)

    tables = [init for init in graph.initializer if len(init.dims) == 2]
    expected = kind.tables(manifest)
    shapes = sorted(tuple(int(d) for d in t.dims) for t in tables)
    if shapes != sorted(table.shape for table in expected):
        if len(expected) == 1 and len(tables) == 1:
            table = tables[0]
            raise ModelDirError(
                f"{where}: embedding table {table.name!r} is {[int(d) for d in table.dims]}, "
                f"but {field_of} [vocab_size, d_model] is [{manifest.vocab_size}, "
                f"{manifest.d_model}]"
            )
        raise ModelDirError(
            f"{where}: expected {len(expected)} 2-D table(s) of a {kind.name} model "
            f"({', '.join(f'{t.role} {list(t.shape)}' for t in expected)}), found {len(tables)} "
            f"({[(t.name, list(t.dims)) for t in tables]})"
        )
    for table in tables:
        table_dtype = _onnx_dtype_name(table.data_type)
        if table_dtype != manifest.weight_dtype:
            raise ModelDirError(
                f"{where}: table {table.name!r} is {table_dtype}, "
                f"but {field_of} weight_dtype is {manifest.weight_dtype}"
            )
    for init in graph.initializer:
        for item in init.external_data:
            if item.key == "location":
                _safe_member(directory, item.value)
                if item.value not in manifest.files:
                    raise ModelDirError(
                        f"{where}: weights of {init.name!r} live in {item.value!r}, "
                        f"which the manifest does not list"
                    )
    opsets = {op.domain: op.version for op in model.opset_import}
    if opsets.get("", opsets.get("ai.onnx")) != manifest.opset:
        raise ModelDirError(
            f"{where}: graph opset is {opsets.get('', opsets.get('ai.onnx'))}, "
            f"but {field_of} opset is {manifest.opset}"
        )
    graph_scale = _graph_scale(graph, where)
    # The graph multiplies in float32: compare the manifest's scale at that precision.
    if graph_scale != float(np.float32(manifest.scale)):
        raise ModelDirError(
            f"{where}: graph scales rows by {graph_scale!r}, but {field_of} scale is "
            f"{manifest.scale!r}"
        )


def _graph_scale(graph: object, where: str) -> float:
    """The factor the graph multiplies looked-up rows by: the one scalar operand of its one
    Mul, or 1 when there is no Mul (the exporter folds a scale of 1 away)."""
    from onnx import helper, numpy_helper

    nodes = list(graph.node)  # type: ignore[attr-defined]
    muls = [node for node in nodes if node.op_type == "Mul"]
    if not muls:
        return 1.0
    scalars: dict[str, Any] = {
        init.name: init
        for init in graph.initializer  # type: ignore[attr-defined]
        if not init.dims and not init.external_data
    }
    for node in nodes:
        constant = node.op_type == "Constant" and len(node.attribute) == 1
        if constant and node.attribute[0].name in ("value", "value_float"):
            scalars[node.output[0]] = helper.get_attribute_value(node.attribute[0])
    operands = [scalars[name] for name in muls[0].input if name in scalars]
    if len(muls) != 1 or len(operands) != 1:
        raise ModelDirError(
            f"{where}: cannot read the scale: expected one Mul by a scalar constant, "
            f"found {len(muls)} Mul node(s)"
        )
    operand = operands[0]
    values = np.asarray(operand if isinstance(operand, float) else numpy_helper.to_array(operand))
    if values.size != 1:
        raise ModelDirError(f"{where}: cannot read the scale: the Mul's constant is not a scalar")
    return float(values.reshape(()))


def _check_value_info(
    info: object, dtype: str, field: str, rank: int, last_dim: int | None, where: str
) -> None:
    tensor_type = info.type.tensor_type  # type: ignore[attr-defined]
    name = info.name  # type: ignore[attr-defined]
    actual_dtype = _onnx_dtype_name(tensor_type.elem_type)
    if actual_dtype != dtype:
        raise ModelDirError(
            f"{where}: {name!r} is {actual_dtype} in the graph, but manifest.json {field} "
            f"is {dtype}"
        )
    dims = list(tensor_type.shape.dim)
    if len(dims) != rank:
        raise ModelDirError(f"{where}: {name!r} has rank {len(dims)} in the graph, expected {rank}")
    for index, dim in enumerate(dims[:2]):
        if dim.HasField("dim_value"):
            raise ModelDirError(
                f"{where}: {name!r} dimension {index} is fixed to {dim.dim_value}; "
                "batch and sequence must be dynamic"
            )
    if last_dim is not None and dims[-1].dim_value != last_dim:
        raise ModelDirError(
            f"{where}: {name!r} last dimension is {dims[-1].dim_value or dims[-1].dim_param!r}, "
            f"but manifest.json d_model is {last_dim}"
        )


def _onnx_dtype_name(data_type: int) -> str:
    """An ``onnx.TensorProto`` data type, named the way the manifest names it."""
    dtype = of_onnx(data_type)
    return str(data_type) if dtype is None else dtype.name
