"""The ONNX graphs of the segment and factorized kinds, written with ``onnx.helper`` (no
torch), in the order and dtype the libraries that define them compute:

- segment (BERT's ``word_embeddings(ids) + token_type_embeddings(types)``, with the
  manifest's scale applied to the word rows as the source layer does):
  ``Gather(E, input_ids) [* scale] + Gather(S, token_type_ids)``;
- factorized (ALBERT's ``embedding_hidden_mapping_in(word_embeddings(ids))``, a torch
  ``Linear``): ``MatMul(Gather(E, input_ids) [* scale], P) [+ bias]``.

Written by hand rather than traced by torch's exporter: the graph is then exactly these
few nodes, whose float32 results are those of the same IEEE operations in torch (bit for
bit, but for the factorized kind's matmul, which no two libraries sum in the same order),
and each table is written once, straight to ``model.onnx.data``. A table stored in
float16 is gathered in float16 and widened to float32 before any arithmetic (as the token
kind's graph does). The scale is a float32 scalar initializer, left out when it is 1 (a
multiply by 1 is exact), which is what ``model_dir`` reads back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokembed.export.dtypes import FLOAT16, FLOAT32, of_numpy
from tokembed.export.kinds import TOKEN_TYPE_IDS
from tokembed.export.manifest import INPUT_NAME, OUTPUT_NAME
from tokembed.export.table_graph import DATA_NAME, SCALE_NAME, save_graph

# Each table starts on a page in the data file, so that onnxruntime can map it.
_ALIGN = 4096
# What a segment or factorized model's tables may be stored as (no bfloat16 yet).
TABLE_DTYPES = (FLOAT32, FLOAT16)


@dataclass(frozen=True)
class Table:
    """A 2-D initializer written to the data file: its graph name and values."""

    name: str
    values: np.ndarray  # float32 or float16, [rows, cols]


def write_segment_graph(embedding: Table, segment: Table, scale: float, directory: Path) -> int:
    """``model.onnx`` + ``model.onnx.data`` for ``E[id] * scale + S[t]``; returns the opset."""
    from onnx import TensorProto, helper

    d_model = int(embedding.values.shape[1])
    nodes: list[Any] = []
    words = _gather(nodes, embedding, INPUT_NAME, "word_rows")
    words = _scaled(nodes, words, scale)
    types = _gather(nodes, segment, TOKEN_TYPE_IDS, "type_rows")
    nodes.append(helper.make_node("Add", [words, types], [OUTPUT_NAME], name="add_types"))
    ids = [
        helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "sequence"])
        for name in (INPUT_NAME, TOKEN_TYPE_IDS)
    ]
    return _write(nodes, ids, d_model, [embedding, segment], scale, [], directory)


def write_factorized_graph(
    embedding: Table, projection: Table, bias: np.ndarray | None, scale: float, directory: Path
) -> int:
    """``model.onnx`` + ``model.onnx.data`` for ``(E[id] * scale) @ P + bias``, where
    ``projection`` is ``P [D', D]`` (a ``Linear``'s weight transposed) and ``bias`` is
    float32 ``[D]`` or None; returns the opset."""
    from onnx import TensorProto, helper, numpy_helper

    d_model = int(projection.values.shape[1])
    nodes: list[Any] = []
    rows = _gather(nodes, embedding, INPUT_NAME, "rows")
    rows = _scaled(nodes, rows, scale)
    weight = _widened(nodes, projection.name, projection.values.dtype)
    extra: list[Any] = []
    if bias is None:
        nodes.append(helper.make_node("MatMul", [rows, weight], [OUTPUT_NAME], name="project"))
    else:
        nodes.append(helper.make_node("MatMul", [rows, weight], ["projected"], name="project"))
        nodes.append(helper.make_node("Add", ["projected", "bias"], [OUTPUT_NAME], name="bias"))
        extra.append(numpy_helper.from_array(np.ascontiguousarray(bias, "<f4"), "bias"))
    ids = [helper.make_tensor_value_info(INPUT_NAME, TensorProto.INT64, ["batch", "sequence"])]
    return _write(nodes, ids, d_model, [embedding, projection], scale, extra, directory)


def _gather(nodes: list[Any], table: Table, ids: str, out: str) -> str:
    """Rows of ``table`` by ``ids``, as float32 (a float16 table is widened after)."""
    from onnx import TensorProto, helper

    if table.values.dtype == np.float32:
        nodes.append(helper.make_node("Gather", [table.name, ids], [out], name=out, axis=0))
        return out
    nodes.append(helper.make_node("Gather", [table.name, ids], [f"{out}_stored"], axis=0))
    nodes.append(helper.make_node("Cast", [f"{out}_stored"], [out], to=TensorProto.FLOAT))
    return out


def _widened(nodes: list[Any], name: str, dtype: np.dtype) -> str:
    from onnx import TensorProto, helper

    if dtype == np.float32:
        return name
    nodes.append(helper.make_node("Cast", [name], [f"{name}_float"], to=TensorProto.FLOAT))
    return f"{name}_float"


def _scaled(nodes: list[Any], rows: str, scale: float) -> str:
    from onnx import helper

    if float(np.float32(scale)) == 1.0:
        return rows
    nodes.append(helper.make_node("Mul", [rows, SCALE_NAME], ["scaled"], name="scale_rows"))
    return "scaled"


def _write(
    nodes: list[Any],
    inputs: list[Any],
    d_model: int,
    tables: list[Table],
    scale: float,
    extra: list[Any],
    directory: Path,
) -> int:
    from onnx import TensorProto, helper

    initializers = [*_write_tables(tables, directory / DATA_NAME), *extra]
    if float(np.float32(scale)) != 1.0:
        initializers.append(
            helper.make_tensor(SCALE_NAME, TensorProto.FLOAT, [], [float(np.float32(scale))])
        )
    output = helper.make_tensor_value_info(
        OUTPUT_NAME, TensorProto.FLOAT, ["batch", "sequence", d_model]
    )
    graph = helper.make_graph(nodes, "tokembed", inputs, [output], initializer=initializers)
    return save_graph(graph, directory)


def _write_tables(tables: list[Table], data_path: Path) -> list[Any]:
    """Each table's bytes into the data file, page-aligned; their initializers."""
    from onnx import TensorProto

    initializers: list[Any] = []
    with data_path.open("wb") as data:
        for table in tables:
            values = table.values
            dtype = of_numpy(values.dtype)
            if values.ndim != 2 or dtype is None or dtype not in TABLE_DTYPES:
                raise ValueError(
                    f"this is a bug: {table.name} must be a float32 or float16 2-D array, got "
                    f"{values.dtype}{list(values.shape)}"
                )
            offset = -data.tell() % _ALIGN + data.tell()
            data.seek(offset)
            # ONNX stores tensors little-endian; tofile writes without a second copy.
            np.ascontiguousarray(values, values.dtype.newbyteorder("<")).tofile(data)
            tensor = TensorProto(
                name=table.name,
                data_type=dtype.onnx,
                dims=[int(n) for n in values.shape],
            )
            # Written by hand: onnx's helpers would hold the table in the message first.
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (
                ("location", DATA_NAME),
                ("offset", str(offset)),
                ("length", str(values.nbytes)),
            ):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            initializers.append(tensor)
    return initializers
