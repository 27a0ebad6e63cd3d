"""The ONNX graph of each model kind, written with ``onnx.helper`` (no torch), in the order
and dtype the libraries that define the kind compute:

- token: ``Gather(E, input_ids) [-> Cast to float32] [* scale]``;
- segment (BERT's ``word_embeddings(ids) + token_type_embeddings(types)``, with the
  manifest's scale applied to the word rows as the source layer does):
  ``Gather(E, input_ids) [* scale] + Gather(S, token_type_ids)``;
- factorized (ALBERT's ``embedding_hidden_mapping_in(word_embeddings(ids))``, a torch
  ``Linear``): ``MatMul(Gather(E, input_ids) [* scale], P) [+ bias]``.

Written by hand rather than traced by torch's exporter: the graph is then exactly these
few nodes, whose float32 results are those of the same IEEE operations in torch (bit for
bit, but for the factorized kind's matmul, which no two libraries sum in the same order),
and each table is written once, straight to ``model.onnx.data``, never built as an ONNX
tensor in memory. A table stored narrower than float32 is gathered in its dtype and
widened to float32 before any arithmetic. The scale is a float32 scalar initializer, left
out when it is 1 in float32 (a multiply by 1 is exact), which is what ``model_dir`` reads
back.

The token kind's table may be gigabytes: whoever writes it streams it into
``model.onnx.data`` first (``parts.TokenPart``), and ``write_token_graph`` only points at
it. The other kinds' tables are written here, from arrays (``write_segment_graph``,
``write_factorized_graph``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokembed import __version__
from tokembed.export.dtypes import FLOAT16, FLOAT32, WEIGHT_DTYPES, of_numpy
from tokembed.export.kinds import TOKEN_TYPE_IDS
from tokembed.export.manifest import INPUT_NAME, MODEL_NAME, OUTPUT_NAME

# The opset torch's exporter wrote when it still wrote the token kind's graph, kept for
# every graph written here; onnxruntime >= 1.17 runs it.
OPSET = 20
DATA_NAME = f"{MODEL_NAME}.data"
TABLE_NAME = "embedding.weight"
SCALE_NAME = "scale"
# Each table after the first starts on a page in the data file, so that onnxruntime can
# map it.
_ALIGN = 4096
# What a segment or factorized model's tables may be stored as (no bfloat16 yet).
TABLE_DTYPES = (FLOAT32, FLOAT16)


@dataclass(frozen=True)
class Table:
    """A 2-D initializer written to the data file: its graph name and values."""

    name: str
    values: np.ndarray  # float32 or float16, [rows, cols]


def write_table_graph(table: np.ndarray, scale: float, directory: Path) -> int:
    """Write ``model.onnx`` and ``model.onnx.data`` into ``directory`` for a float32 [V, D]
    ``table`` multiplied by ``scale`` (in float32); return the opset."""
    if table.ndim != 2 or table.dtype != np.float32:
        raise ValueError(f"expected a float32 [V, D] table, got {table.dtype}{list(table.shape)}")
    vocab_size, d_model = (int(n) for n in table.shape)
    data = np.ascontiguousarray(table, dtype="<f4")  # ONNX stores tensors little-endian
    data.tofile(directory / DATA_NAME)
    return write_token_graph(directory, vocab_size, d_model, "float32", scale)


def write_token_graph(
    directory: Path, vocab_size: int, d_model: int, weight_dtype: str, scale: float
) -> int:
    """Write ``model.onnx`` into ``directory`` for the ``[V, D]`` table of ``weight_dtype``
    that ``directory/model.onnx.data`` already holds (row after row, little-endian), its
    rows widened to float32 and multiplied by ``scale`` in float32; return the opset."""
    from onnx import TensorProto, helper

    stored = WEIGHT_DTYPES.get(weight_dtype)
    if stored is None:
        raise ValueError(f"no ONNX graph for a {weight_dtype} table")
    length = vocab_size * d_model * stored.itemsize
    written = (directory / DATA_NAME).stat().st_size
    if written != length:
        raise ValueError(f"{DATA_NAME} holds {written} bytes, a [{vocab_size}, {d_model}] "
                         f"{weight_dtype} table {length}")  # fmt: skip

    nodes: list[Any] = []
    # Each node reads the one before; the last writes the output.
    unscaled = _is_one(scale)
    rows = _gather(nodes, TABLE_NAME, stored.onnx, INPUT_NAME, OUTPUT_NAME if unscaled else "rows")
    _scaled(nodes, rows, scale, OUTPUT_NAME)
    weight = _external(TABLE_NAME, stored.onnx, [vocab_size, d_model], 0, length)
    ids = [helper.make_tensor_value_info(INPUT_NAME, TensorProto.INT64, ["batch", "sequence"])]
    return _write(nodes, ids, d_model, [weight], scale, directory)


def write_segment_graph(embedding: Table, segment: Table, scale: float, directory: Path) -> int:
    """``model.onnx`` + ``model.onnx.data`` for ``E[id] * scale + S[t]``; returns the opset."""
    from onnx import TensorProto, helper

    d_model = int(embedding.values.shape[1])
    nodes: list[Any] = []
    words = _gather(nodes, embedding.name, _onnx_type(embedding), INPUT_NAME, "word_rows")
    words = _scaled(nodes, words, scale, "scaled")
    types = _gather(nodes, segment.name, _onnx_type(segment), TOKEN_TYPE_IDS, "type_rows")
    nodes.append(helper.make_node("Add", [words, types], [OUTPUT_NAME], name="add_types"))
    ids = [
        helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "sequence"])
        for name in (INPUT_NAME, TOKEN_TYPE_IDS)
    ]
    tables = _write_tables([embedding, segment], directory / DATA_NAME)
    return _write(nodes, ids, d_model, tables, scale, directory)


def write_factorized_graph(
    embedding: Table, projection: Table, bias: np.ndarray | None, scale: float, directory: Path
) -> int:
    """``model.onnx`` + ``model.onnx.data`` for ``(E[id] * scale) @ P + bias``, where
    ``projection`` is ``P [D', D]`` (a ``Linear``'s weight transposed) and ``bias`` is
    float32 ``[D]`` or None; returns the opset."""
    from onnx import TensorProto, helper, numpy_helper

    d_model = int(projection.values.shape[1])
    nodes: list[Any] = []
    rows = _gather(nodes, embedding.name, _onnx_type(embedding), INPUT_NAME, "rows")
    rows = _scaled(nodes, rows, scale, "scaled")
    weight = projection.name
    if projection.values.dtype != np.float32:
        weight = f"{projection.name}_float"
        nodes.append(helper.make_node("Cast", [projection.name], [weight], to=TensorProto.FLOAT))
    initializers = _write_tables([embedding, projection], directory / DATA_NAME)
    if bias is None:
        nodes.append(helper.make_node("MatMul", [rows, weight], [OUTPUT_NAME], name="project"))
    else:
        nodes.append(helper.make_node("MatMul", [rows, weight], ["projected"], name="project"))
        nodes.append(helper.make_node("Add", ["projected", "bias"], [OUTPUT_NAME], name="bias"))
        initializers.append(numpy_helper.from_array(np.ascontiguousarray(bias, "<f4"), "bias"))
    ids = [helper.make_tensor_value_info(INPUT_NAME, TensorProto.INT64, ["batch", "sequence"])]
    return _write(nodes, ids, d_model, initializers, scale, directory)


def save_graph(graph: Any, directory: Path) -> int:
    """Write ``graph`` (an ``onnx.GraphProto`` whose tables are external data already in
    ``directory``) as ``directory/model.onnx`` at ``OPSET``, check it, and return the opset.
    Every graph the exporter writes goes through here."""
    import onnx
    from onnx import helper

    opsets = [helper.make_opsetid("", OPSET)]
    model = helper.make_model(
        graph, opset_imports=opsets, producer_name="tokembed", producer_version=__version__
    )
    # The oldest IR version that carries this opset, not the installed onnx's newest: an
    # older onnxruntime refuses IR versions it does not know.
    model.ir_version = helper.find_min_ir_version_for(opsets)
    model_path = directory / MODEL_NAME
    model_path.write_bytes(model.SerializeToString())
    # Given a path, the checker follows the external data too (and never loads it whole).
    onnx.checker.check_model(str(model_path))
    return OPSET


def _is_one(scale: float) -> bool:
    return float(np.float32(scale)) == 1.0


def _gather(nodes: list[Any], table: str, stored: int, ids: str, out: str) -> str:
    """Rows of ``table`` (of ONNX type ``stored``) by ``ids`` into ``out``, as float32 (a
    narrower table is widened after the gather)."""
    from onnx import TensorProto, helper

    if stored == TensorProto.FLOAT:
        nodes.append(helper.make_node("Gather", [table, ids], [out], name=f"{out}_gather", axis=0))
        return out
    nodes.append(helper.make_node("Gather", [table, ids], [f"{out}_stored"], axis=0))
    nodes.append(helper.make_node("Cast", [f"{out}_stored"], [out], to=TensorProto.FLOAT))
    return out


def _scaled(nodes: list[Any], rows: str, scale: float, out: str) -> str:
    """``rows * scale`` into ``out``; ``rows`` itself when the scale is 1."""
    from onnx import helper

    if _is_one(scale):
        return rows
    nodes.append(helper.make_node("Mul", [rows, SCALE_NAME], [out], name="scale_rows"))
    return out


def _write(
    nodes: list[Any],
    inputs: list[Any],
    d_model: int,
    initializers: list[Any],
    scale: float,
    directory: Path,
) -> int:
    from onnx import TensorProto, helper

    if not _is_one(scale):
        initializers = [
            *initializers,
            helper.make_tensor(SCALE_NAME, TensorProto.FLOAT, [], [float(np.float32(scale))]),
        ]
    output = helper.make_tensor_value_info(
        OUTPUT_NAME, TensorProto.FLOAT, ["batch", "sequence", d_model]
    )
    graph = helper.make_graph(nodes, "tokembed", inputs, [output], initializer=initializers)
    return save_graph(graph, directory)


def _onnx_type(table: Table) -> int:
    dtype = of_numpy(table.values.dtype)
    if table.values.ndim != 2 or dtype is None or dtype not in TABLE_DTYPES:
        raise ValueError(
            f"this is a bug: {table.name} must be a float32 or float16 2-D array, got "
            f"{table.values.dtype}{list(table.values.shape)}"
        )
    return dtype.onnx


def _external(name: str, data_type: int, dims: list[int], offset: int, length: int) -> Any:
    """The initializer of a table ``DATA_NAME`` holds at ``offset``. Written by hand:
    onnx's own helpers move raw_data out of a tensor, and building the tensor in memory
    first would hold a second copy of a table that may be gigabytes."""
    from onnx import TensorProto

    tensor = TensorProto(name=name, data_type=data_type, dims=dims)
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", DATA_NAME), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def _write_tables(tables: list[Table], data_path: Path) -> list[Any]:
    """Each table's bytes into the data file, page-aligned; their initializers."""
    initializers: list[Any] = []
    with data_path.open("wb") as data:
        for table in tables:
            values = table.values
            data_type = _onnx_type(table)
            offset = -data.tell() % _ALIGN + data.tell()
            data.seek(offset)
            # ONNX stores tensors little-endian; tofile writes without a second copy.
            np.ascontiguousarray(values, values.dtype.newbyteorder("<")).tofile(data)
            dims = [int(n) for n in values.shape]
            initializers.append(_external(table.name, data_type, dims, offset, values.nbytes))
    return initializers
