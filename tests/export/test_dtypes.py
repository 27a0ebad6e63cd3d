"""The one table of dtypes (``tokembed.export.dtypes``): each row's name in every
vocabulary agrees with that vocabulary's own definition, the server's table is these very
rows, and the exporter's graphs and checks ask it."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import onnx
import torch
from tritonclient.grpc import model_config_pb2 as mc

from tokembed.export import dtypes
from tokembed.export.dtypes import ANSWER_DTYPES, ROWS, SAFETENSORS_DTYPES, WEIGHT_DTYPES
from tokembed.server.core import dtypes as server_dtypes


def test_each_row_names_its_dtype_as_numpy_onnx_torch_and_triton_do() -> None:
    for name, row in ROWS.items():
        assert row.name == name
        assert onnx.helper.tensor_dtype_to_np_dtype(row.onnx) == row.numpy, name
        assert row.torch_dtype() is getattr(torch, name)
        assert row.torch_dtype().itemsize == row.itemsize == row.numpy.itemsize
        assert mc.DataType.Value(row.triton) > 0, name
    assert dtypes.BFLOAT16.numpy == np.dtype(ml_dtypes.bfloat16)
    assert dtypes.of_numpy(np.dtype(np.float16)) is dtypes.FLOAT16
    assert dtypes.of_onnx(onnx.TensorProto.BFLOAT16) is dtypes.BFLOAT16
    assert dtypes.of_onnx(onnx.TensorProto.UINT8) is None


def test_every_safetensors_name_is_a_torch_dtype() -> None:
    for torch_name in SAFETENSORS_DTYPES.values():
        assert isinstance(dtypes.torch_dtype(torch_name), torch.dtype)
    for row in WEIGHT_DTYPES.values():
        assert row.name in SAFETENSORS_DTYPES.values()


def test_the_server_serves_rows_of_the_one_table() -> None:
    for name, row in server_dtypes.OUTPUT_DTYPES.items():
        assert ANSWER_DTYPES[name] is row
    for row in server_dtypes.ID_DTYPES.values():
        assert ROWS[row.name] is row
    assert server_dtypes.DType is dtypes.DType


def test_bits_read_through_an_integer_of_the_same_width() -> None:
    values = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    assert dtypes.torch_bits(values).tolist() == [0x3F80, 0xC000]
    assert dtypes.bits(np.array([1.0], dtype=np.float32)).tolist() == [0x3F800000]


def test_the_table_imports_neither_torch_nor_numpy_until_asked() -> None:
    """The server imports the table and never torch; the command line lists its names in
    its parser and starts without numpy."""
    code = (
        "import sys; from tokembed.export import dtypes; names = list(dtypes.WEIGHT_DTYPES); "
        "before = sorted(m for m in ('numpy', 'torch') if m in sys.modules); "
        "dtypes.BFLOAT16.numpy; "
        "print(before, sorted(m for m in ('numpy', 'torch') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[] ['numpy']\n"
