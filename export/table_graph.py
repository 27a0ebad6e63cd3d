"""The ONNX graph of a look-up table, written with ``onnx.helper`` (no torch).

The same graph the exporter gets from torch: ``Gather(table, input_ids)``, widened to
float32 by a ``Cast`` when the table is stored in another dtype, times ``scale`` (no
``Mul`` for a scale of 1); input ``input_ids`` int64 ``[batch, sequence]``, output
``hidden_states`` float32 ``[batch, sequence, D]``, the table as external data in
``model.onnx.data`` and the scale as a float32 scalar initializer beside the graph,
which is what ``model_dir`` reads back.

The graph is written apart from its table (``write_graph``): whoever writes the table
streams it into ``model.onnx.data`` first, so that no ONNX tensor of it is ever built in
memory (torch's exporter holds the table two or three times over while it exports).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tokembed import __version__
from tokembed.export.dtypes import WEIGHT_DTYPES
from tokembed.export.manifest import INPUT_NAME, MODEL_NAME, OUTPUT_NAME

# The opset torch's exporter writes today, for every graph written here and in
# kind_graphs; onnxruntime >= 1.17 runs it.
OPSET = 20
DATA_NAME = f"{MODEL_NAME}.data"
TABLE_NAME = "embedding.weight"
SCALE_NAME = "scale"


def write_table_graph(table: np.ndarray, scale: float, directory: Path) -> int:
    """Write ``model.onnx`` and ``model.onnx.data`` into ``directory`` for a float32 [V, D]
    ``table`` multiplied by ``scale`` (in float32); return the opset."""
    if table.ndim != 2 or table.dtype != np.float32:
        raise ValueError(f"expected a float32 [V, D] table, got {table.dtype}{list(table.shape)}")
    vocab_size, d_model = (int(n) for n in table.shape)
    data = np.ascontiguousarray(table, dtype="<f4")  # ONNX stores tensors little-endian
    data.tofile(directory / DATA_NAME)
    return write_graph(directory, vocab_size, d_model, "float32", scale)


def write_graph(
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

    weight = TensorProto(name=TABLE_NAME, data_type=stored.onnx, dims=[vocab_size, d_model])
    # Written by hand: onnx's own helpers move raw_data out of a tensor, and building the
    # tensor in memory first would hold a second copy of a table that may be gigabytes.
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", DATA_NAME), ("offset", "0"), ("length", str(length))):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    initializers = [weight]

    # Gather -> (Cast) -> (Mul): each node reads the one before; the last writes the output.
    cast, mul = weight_dtype != "float32", scale != 1.0
    rows = OUTPUT_NAME if not (cast or mul) else ("stored_rows" if cast else "rows")
    nodes = [helper.make_node("Gather", [TABLE_NAME, INPUT_NAME], [rows], name="lookup", axis=0)]
    if cast:
        widened = "rows" if mul else OUTPUT_NAME
        nodes.append(
            helper.make_node("Cast", [rows], [widened], name="widen", to=TensorProto.FLOAT)
        )
        rows = widened
    if mul:
        nodes.append(helper.make_node("Mul", [rows, SCALE_NAME], [OUTPUT_NAME], name="scale_rows"))
        initializers.append(
            helper.make_tensor(SCALE_NAME, TensorProto.FLOAT, [], [float(np.float32(scale))])
        )

    graph = helper.make_graph(
        nodes,
        "tokembed",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.INT64, ["batch", "sequence"])],
        [
            helper.make_tensor_value_info(
                OUTPUT_NAME, TensorProto.FLOAT, ["batch", "sequence", d_model]
            )
        ],
        initializer=initializers,
    )
    return save_graph(graph, directory)


def save_graph(graph: Any, directory: Path) -> int:
    """Write ``graph`` (an ``onnx.GraphProto`` whose tables are external data already in
    ``directory``) as ``directory/model.onnx`` at ``OPSET``, check it, and return the opset.
    Every graph the exporter writes by hand goes through here."""
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
