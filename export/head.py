"""The head graph: vectors back to ids through the model's output table, ``head.onnx``.

``logits = norm?(h) @ W.T`` (``MatMul`` of ``W`` widened to float32, after the model's
final norm when it has one), then ``TopK`` of them: inputs ``vectors`` float32
``[n, D]`` and ``k`` int64 ``[1]``; outputs ``scores`` float32 ``[n, k]``, ``ids`` int64
``[n, k]`` and ``logits`` float32 ``[n, V]``. It is written beside a model directory's
look-up graph, checked in onnxruntime against a float64 reference (``check_head``), and
recorded in the manifest (``manifest.Head``), so that a backend on an accelerator can
run it; the CPU backend computes the same multiply from the table it reads (see
``tokembed.server.backends.head``).

``W`` is the exported table itself when the model is tied: the head graph then points at
the bytes ``model.onnx`` already keeps (the same external data, offset and length), so a
tied head costs no second copy on disk. An untied output projection is written to
``head.onnx.data`` in the model's weight dtype.

torch-free: the exporter reads the checkpoint (``head_cli``) and hands arrays here.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokembed.export.dtypes import WEIGHT_DTYPES
from tokembed.export.errors import ExportError, ParityError
from tokembed.export.graphs import TABLE_NAME
from tokembed.export.hashing import sha256_file
from tokembed.export.kinds import FACTORIZED
from tokembed.export.manifest import (
    INPUT_NAME,
    MANIFEST_NAME,
    MODEL_NAME,
    OUTPUT_NAME,
    SERVED,
    FileEntry,
    Head,
    Manifest,
    Norm,
    Parity,
)

HEAD_NAME = "head.onnx"
HEAD_DATA_NAME = f"{HEAD_NAME}.data"
VECTORS = "vectors"
K = "k"
SCORES = "scores"
IDS = "ids"
LOGITS = "logits"
HEAD_TABLE_NAME = "head.weight"
NORM_WEIGHT = "norm.weight"
NORM_BIAS = "norm.bias"
# The parity check's vectors and the k it asks for.
_PARITY_VECTORS = 64
_PARITY_K = 8
_REFERENCE_SLICE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class NormArrays:
    """The final norm as the head applies it: its record and its float32 parameters."""

    record: Norm
    weight: np.ndarray  # [D]
    bias: np.ndarray | None  # [D], LayerNorm's


def apply_norm(vectors: np.ndarray, norm: NormArrays | None) -> np.ndarray:
    """The reference of the norm, in float64 (the parity check's; the server's backend
    computes the same in float32)."""
    if norm is None:
        return vectors.astype(np.float64)
    h = vectors.astype(np.float64)
    eps, weight = norm.record.eps, norm.weight.astype(np.float64)
    if norm.record.kind == "rmsnorm":
        out = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * weight
    else:
        centred = h - h.mean(axis=-1, keepdims=True)
        out = centred / np.sqrt(np.mean(centred * centred, axis=-1, keepdims=True) + eps) * weight
        if norm.bias is not None:
            out = out + norm.bias.astype(np.float64)
    return np.asarray(out)


def write_head(
    directory: Path,
    manifest: Manifest,
    *,
    output_table: np.ndarray | None,
    output_key: str | None,
    norm: NormArrays | None,
    seed: int = 0,
) -> Manifest:
    """Write the head graph into ``directory`` (an export's staging directory, where the
    look-up graph of ``manifest`` is), check it, and return ``manifest`` with the head
    recorded (the exporter's ``pipeline.Addition``: the pipeline lists the files and
    writes the manifest once).

    ``output_table``: an untied output projection ``[V, D]`` (any float dtype; stored in
    the model's weight dtype); None: the model is tied, and the head reads the exported
    table. ``ExportError`` when the table does not fit the model; ``ParityError`` when
    onnxruntime disagrees with the reference.
    """
    vocab_size, d_model = manifest.vocab_size, manifest.d_model
    stored = WEIGHT_DTYPES[manifest.weight_dtype]
    if norm is not None:
        for name, array in (("weight", norm.weight), ("bias", norm.bias)):
            if array is not None and array.shape != (d_model,):
                raise ExportError(
                    f"the final norm's {name} is {list(array.shape)}, the model's width is "
                    f"[{d_model}]"
                )
    role = "embedding" if output_table is None else "output"
    if manifest.kind == FACTORIZED:
        if output_table is not None:
            raise ExportError(
                f"a factorized model's head is over the vectors it serves (E [V, D'] "
                f"projected to D): its output projection {output_key!r} must be tied to the "
                "[V, D'] table, and is not"
            )
        role, stored = SERVED, WEIGHT_DTYPES["float32"]
        weight = _write_served_table(directory, vocab_size, d_model)
        table_entry = _external_tensor(
            HEAD_DATA_NAME, 0, weight.nbytes, stored.onnx, vocab_size, d_model
        )
    elif output_table is None:
        table_entry = _tied_table_entry(directory, vocab_size, d_model)
        table_file = _external_location(table_entry)
        weight = _stored_view(
            directory / table_file, table_entry, stored.numpy, vocab_size, d_model
        )
    else:
        if output_table.shape != (vocab_size, d_model):
            raise ExportError(
                f"the output projection {output_key!r} is {list(output_table.shape)}, the "
                f"model's table [{vocab_size}, {d_model}]"
            )
        weight = np.ascontiguousarray(output_table.astype(stored.numpy))
        weight.tofile(directory / HEAD_DATA_NAME)
        table_entry = _external_tensor(
            HEAD_DATA_NAME, 0, weight.nbytes, stored.onnx, vocab_size, d_model
        )
    _write_graph(directory, table_entry, stored.name, d_model, vocab_size, norm, manifest.opset)
    parity = check_head(directory / HEAD_NAME, weight, norm, seed)
    head = Head(
        table=role,
        output_key=output_key,
        graph=HEAD_NAME,
        weight_dtype=stored.name,
        parity=parity,
        norm=None if norm is None else norm.record,
    )
    return dataclasses.replace(manifest, head=head)


def add_head(
    directory: Path,
    *,
    output_table: np.ndarray | None,
    output_key: str | None,
    norm: NormArrays | None,
    seed: int = 0,
) -> Head:
    """``write_head`` into a model directory already published, its manifest rewritten
    in one rename: for the tests' and the bench's fixtures, which make a directory first
    and add its head after. The exporter never does this: it stages the head with the
    rest of the directory (``pipeline.ExportOptions.additions``), so that a reader never
    sees the model without it."""
    manifest = Manifest.read(directory)
    updated = write_head(
        directory, manifest, output_table=output_table, output_key=output_key, norm=norm,
        seed=seed,
    )  # fmt: skip
    files = dict(manifest.files)
    for name in (HEAD_NAME, HEAD_DATA_NAME):
        if (directory / name).is_file():
            files[name] = _entry(directory / name)
    updated = dataclasses.replace(updated, files=files)
    # Checked through the reader before it replaces the manifest: what is written reads back.
    Manifest.from_dict(json.loads(updated.to_json()), where=str(directory / MANIFEST_NAME))
    staged = directory / f".{MANIFEST_NAME}.head"
    staged.write_text(updated.to_json(), encoding="utf-8")
    os.replace(staged, directory / MANIFEST_NAME)
    assert updated.head is not None
    return updated.head


def check_head(path: Path, weight: np.ndarray, norm: NormArrays | None, seed: int) -> Parity:
    """onnxruntime's head against a float64 reference on seeded random vectors.

    The scores may differ by float32 accumulation over D products: the tolerance is
    ``2 (D + 8) 2**-24`` times the largest ``|h| . |W|`` (the error bound of a float32 dot
    product, with room for the norm's own rounding). The ids must be the reference's, or
    ids whose reference score is within the tolerance of the one at their rank (a near
    tie that float32 may order either way).
    """
    import onnxruntime as ort

    vocab_size, d_model = weight.shape
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((_PARITY_VECTORS, d_model)).astype(np.float32)
    k = min(_PARITY_K, vocab_size)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    scores, ids, logits = session.run(
        [SCORES, IDS, LOGITS], {VECTORS: vectors, K: np.asarray([k], dtype=np.int64)}
    )
    normed = apply_norm(vectors, norm)
    # The reference a slice of the table's rows at a time: no float64 copy of a table that
    # may be gigabytes.
    want = np.empty((len(vectors), vocab_size), dtype=np.float64)
    largest = 0.0
    step = max(1, _REFERENCE_SLICE_BYTES // (8 * d_model))
    for start in range(0, vocab_size, step):
        rows = np.asarray(weight[start : start + step], dtype=np.float64)
        want[:, start : start + step] = normed @ rows.T
        largest = max(largest, float((np.abs(normed) @ np.abs(rows).T).max()))
    tolerance = float(2 * (d_model + 8) * 2.0**-24 * largest)
    error = float(np.max(np.abs(logits.astype(np.float64) - want)))
    top = -np.sort(-want, axis=1)[:, :k]
    picked = np.take_along_axis(want, ids.astype(np.int64), axis=1)
    rank_error = float(np.max(np.abs(picked - top)))
    score_error = float(np.max(np.abs(scores.astype(np.float64) - top)))
    worst = max(error, score_error)
    if not (worst <= tolerance and rank_error <= 2 * tolerance):
        raise ParityError(
            f"the head graph differs from the float64 reference: logits by {error:g}, "
            f"top-{k} scores by {score_error:g}, ranks by {rank_error:g} (tolerance "
            f"{tolerance:g}) over {_PARITY_VECTORS} vectors"
        )
    return Parity(max_abs_error=worst, tolerance=tolerance, ids_checked=_PARITY_VECTORS * k)


def head_table(directory: Path, manifest: Manifest) -> np.ndarray:
    """The head's ``W [V, D]`` in its stored dtype, memory-mapped read-only from the file the
    head graph names (the server's CPU backend reads it so; ``head.onnx`` is hashed by the
    manifest, which ``model_dir`` has checked)."""
    import onnx

    head = manifest.head
    if head is None:
        raise ExportError(f"{directory}: the manifest records no head")
    graph = onnx.load(str(directory / head.graph), load_external_data=False).graph
    table = next((init for init in graph.initializer if init.name == HEAD_TABLE_NAME), None)
    if table is None:
        raise ExportError(f"{directory / head.graph}: no initializer {HEAD_TABLE_NAME!r}")
    stored = WEIGHT_DTYPES[head.weight_dtype]
    return _stored_view(
        directory / _external_location(table), table, stored.numpy,
        manifest.vocab_size, manifest.d_model,
    )  # fmt: skip


def norm_arrays(directory: Path, manifest: Manifest) -> NormArrays | None:
    """The head's final norm with its parameters, read from the head graph."""
    import onnx
    from onnx import numpy_helper

    head = manifest.head
    if head is None or head.norm is None:
        return None
    graph = onnx.load(str(directory / head.graph), load_external_data=False).graph
    arrays = {init.name: numpy_helper.to_array(init) for init in graph.initializer
              if init.name in (NORM_WEIGHT, NORM_BIAS)}  # fmt: skip
    if NORM_WEIGHT not in arrays:
        raise ExportError(f"{directory / head.graph}: the norm's weight is missing")
    return NormArrays(head.norm, arrays[NORM_WEIGHT], arrays.get(NORM_BIAS))


# --- the graph


def _write_graph(
    directory: Path,
    table: Any,
    weight_dtype: str,
    d_model: int,
    vocab_size: int,
    norm: NormArrays | None,
    opset: int,
) -> None:
    import onnx
    from onnx import TensorProto, helper

    from tokembed import __version__

    initializers = [table]
    nodes = []
    hidden = VECTORS
    if norm is not None:
        nodes += _norm_nodes(norm, initializers)
        hidden = "normed"
    weight = HEAD_TABLE_NAME
    if weight_dtype != "float32":
        nodes.append(
            helper.make_node("Cast", [weight], ["table"], name="widen", to=TensorProto.FLOAT)
        )
        weight = "table"
    # Gemm with transB reads W [V, D] as it is stored: no transposed copy of the table.
    nodes.append(helper.make_node("Gemm", [hidden, weight], [LOGITS], name="head", transB=1))
    nodes.append(
        helper.make_node(
            "TopK", [LOGITS, K], [SCORES, IDS], name="top_k", axis=-1, largest=1, sorted=1
        )
    )
    graph = helper.make_graph(
        nodes,
        "tokembed-head",
        [
            helper.make_tensor_value_info(VECTORS, TensorProto.FLOAT, ["vectors", d_model]),
            helper.make_tensor_value_info(K, TensorProto.INT64, [1]),
        ],
        [
            helper.make_tensor_value_info(SCORES, TensorProto.FLOAT, ["vectors", "k"]),
            helper.make_tensor_value_info(IDS, TensorProto.INT64, ["vectors", "k"]),
            helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["vectors", vocab_size]),
        ],
        initializer=initializers,
    )
    opsets = [helper.make_opsetid("", opset)]
    model = helper.make_model(
        graph, opset_imports=opsets, producer_name="tokembed", producer_version=__version__
    )
    model.ir_version = helper.find_min_ir_version_for(opsets)
    path = directory / HEAD_NAME
    path.write_bytes(model.SerializeToString())
    onnx.checker.check_model(str(path))


def _norm_nodes(norm: NormArrays, initializers: list[Any]) -> list[Any]:
    """RMSNorm (composed: opset 20 has no RMSNormalization) or LayerNormalization."""
    from onnx import TensorProto, helper, numpy_helper

    initializers.append(numpy_helper.from_array(norm.weight.astype(np.float32), NORM_WEIGHT))
    eps = np.float32(norm.record.eps)
    if norm.record.kind == "layernorm":
        inputs = [VECTORS, NORM_WEIGHT]
        if norm.bias is not None:
            initializers.append(numpy_helper.from_array(norm.bias.astype(np.float32), NORM_BIAS))
            inputs.append(NORM_BIAS)
        return [helper.make_node(
            "LayerNormalization", inputs, ["normed"], name="norm", axis=-1, epsilon=float(eps)
        )]  # fmt: skip
    initializers += [
        helper.make_tensor("norm.eps", TensorProto.FLOAT, [], [float(eps)]),
        helper.make_tensor("norm.axes", TensorProto.INT64, [1], [-1]),
    ]
    return [
        helper.make_node("Mul", [VECTORS, VECTORS], ["squares"], name="square"),
        helper.make_node("ReduceMean", ["squares", "norm.axes"], ["mean_square"], keepdims=1),
        helper.make_node("Add", ["mean_square", "norm.eps"], ["variance"]),
        helper.make_node("Sqrt", ["variance"], ["rms"]),
        helper.make_node("Div", [VECTORS, "rms"], ["scaled"]),
        helper.make_node("Mul", ["scaled", NORM_WEIGHT], ["normed"], name="norm_weight"),
    ]


# --- the table's bytes


def _tied_table_entry(directory: Path, vocab_size: int, d_model: int) -> Any:
    """The exported table's initializer in ``model.onnx``, renamed for the head graph: the
    same external data (file, offset, length), so the head reads the same bytes."""
    import onnx

    graph = onnx.load(str(directory / MODEL_NAME), load_external_data=False).graph
    tables = [init for init in graph.initializer
              if [int(d) for d in init.dims] == [vocab_size, d_model]]  # fmt: skip
    named = [init for init in tables if init.name == TABLE_NAME]
    if named:  # a segment model's [T, D] type table may be [V, D] too
        tables = named
    if len(tables) != 1 or not tables[0].external_data:
        raise ExportError(
            f"{directory / MODEL_NAME}: no single external [{vocab_size}, {d_model}] table "
            "for a tied head to read"
        )
    entry = onnx.TensorProto()
    entry.CopyFrom(tables[0])
    entry.name = HEAD_TABLE_NAME
    return entry


def _write_served_table(directory: Path, vocab_size: int, d_model: int) -> np.ndarray:
    """A factorized model's served vectors of every id (``model.onnx`` in onnxruntime, a
    slice of ids at a time, as the server's table backend computes them at load), written
    float32 to ``head.onnx.data``; returns them memory-mapped."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(directory / MODEL_NAME), providers=["CPUExecutionProvider"])
    step = max(1, _REFERENCE_SLICE_BYTES // (4 * d_model))
    path = directory / HEAD_DATA_NAME
    with path.open("wb") as out:
        for start in range(0, vocab_size, step):
            ids = np.arange(start, min(start + step, vocab_size), dtype=np.int64)[None, :]
            rows = session.run([OUTPUT_NAME], {INPUT_NAME: ids})[0][0]
            out.write(np.ascontiguousarray(rows, dtype="<f4").tobytes())
    return np.memmap(path, dtype=np.float32, mode="r", shape=(vocab_size, d_model))


def _external_tensor(
    location: str, offset: int, length: int, data_type: int, rows: int, cols: int
) -> Any:
    from onnx import TensorProto

    tensor = TensorProto(name=HEAD_TABLE_NAME, data_type=data_type, dims=[rows, cols])
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        item = tensor.external_data.add()
        item.key, item.value = key, value
    return tensor


def _external_location(tensor: Any) -> str:
    return str(next(item.value for item in tensor.external_data if item.key == "location"))


def _stored_view(path: Path, tensor: Any, dtype: np.dtype, rows: int, cols: int) -> np.ndarray:
    """A tensor's external bytes, memory-mapped read-only as ``[rows, cols]``."""
    fields = {item.key: item.value for item in tensor.external_data}
    offset = int(fields.get("offset", "0"))
    length = rows * cols * dtype.itemsize
    if int(fields.get("length", str(length))) != length:
        raise ExportError(f"{path}: the table's length is {fields['length']}, expected {length}")
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(rows, cols))


def _entry(path: Path) -> FileEntry:
    return FileEntry(sha256=sha256_file(path, label=f"hashing {path.name}"),
                     size_bytes=path.stat().st_size)  # fmt: skip
