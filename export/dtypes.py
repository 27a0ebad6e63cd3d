"""The one table of the dtypes tokembed stores and serves: a dtype is a row, with its name
in each vocabulary the project speaks (manifests and requests, numpy, onnx, the Open
Inference Protocol and Triton, torch), and its width.

It lives here, beside the model directory's contract, because both sides of the project
ask it: the exporter, and the server, which may import ``export``'s contract but is
never imported by it (docs/architecture.md). The server's own table
(``tokembed.server.core.dtypes``) is these rows, with what it serves chosen from them.
Torch is the exporter's alone: a row's torch dtype is looked up, and torch imported, only
when ``torch_dtype`` is called, so the server, which never imports torch, imports this
module freely. numpy is imported when a row's ``numpy`` is first read, so that the
command line, which lists these names in its parser, starts without it.

The other vocabulary here is a checkpoint's: the dtypes a safetensors header may name,
most of which tokembed neither stores nor serves (a float64 checkpoint is widened), so
they are torch's names rather than rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch


# eq=False: a row is its own identity (the rows below are the only ones), so tables keyed by
# a DType hash it as any object, with no code of this module run per look-up.
@dataclass(frozen=True, eq=False)
class DType:
    name: str  # as manifests, requests, metrics and logs name it; torch's name too
    itemsize: int  # bytes per value
    onnx: int  # onnx.TensorProto's data type
    v2: str  # the Open Inference Protocol's datatype name
    # numpy's, little-endian (the wire's and the files' byte order); "ml_dtypes.<name>"
    # for a type numpy has none of.
    numpy_type: str

    @functools.cached_property
    def numpy(self) -> np.dtype:
        """numpy's dtype (read per request: computed once, then a plain attribute)."""
        import numpy as np

        if self.numpy_type.startswith("ml_dtypes."):
            import ml_dtypes

            dtype: np.dtype = np.dtype(getattr(ml_dtypes, self.numpy_type.split(".")[1]))
            return dtype
        return np.dtype(self.numpy_type)

    @property
    def triton(self) -> str:
        """Triton's model configuration name (``config.pbtxt``'s ``data_type``)."""
        return f"TYPE_{self.v2}"

    def torch_dtype(self) -> torch.dtype:
        """torch's dtype of this row (imports torch: the exporter's only)."""
        return torch_dtype(self.name)


FLOAT32 = DType("float32", 4, 1, "FP32", "<f4")
FLOAT16 = DType("float16", 2, 10, "FP16", "<f2")
# ml_dtypes' type (onnx's too): numpy has none. Its values are stored in native order,
# little-endian on every machine tokembed runs on.
BFLOAT16 = DType("bfloat16", 2, 16, "BF16", "ml_dtypes.bfloat16")
INT64 = DType("int64", 8, 7, "INT64", "<i8")
INT32 = DType("int32", 4, 6, "INT32", "<i4")
# Neither stored nor served: a row so that a graph or a checkpoint holding it is named.
FLOAT64 = DType("float64", 8, 11, "FP64", "<f8")

ROWS: dict[str, DType] = {d.name: d for d in (FLOAT32, FLOAT16, BFLOAT16, INT64, INT32, FLOAT64)}
# What a model's table may be stored as (the manifest's ``weight_dtype``).
WEIGHT_DTYPES: dict[str, DType] = {d.name: d for d in (FLOAT32, FLOAT16, BFLOAT16)}
# What an answer may be asked for (the server serves each, the exporter checks each).
ANSWER_DTYPES: dict[str, DType] = {d.name: d for d in (FLOAT32, FLOAT16, BFLOAT16)}

_BY_ONNX = {d.onnx: d for d in ROWS.values()}

# safetensors' dtype names, as torch names them.
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def of_numpy(dtype: np.dtype) -> DType | None:
    """The row of a numpy dtype (None: not one of the table's)."""
    return _by_numpy().get(dtype)


@functools.cache
def _by_numpy() -> dict[np.dtype, DType]:
    return {row.numpy: row for row in ROWS.values()}


def of_onnx(data_type: int) -> DType | None:
    """The row of an ``onnx.TensorProto`` data type (None: not one of the table's)."""
    return _BY_ONNX.get(data_type)


def torch_dtype(name: str) -> torch.dtype:
    """torch's dtype of that name (a row's, or one a checkpoint may hold)."""
    import torch

    dtype = getattr(torch, name)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"this is a bug: torch has no dtype {name!r}")
    return dtype


def bits(values: np.ndarray) -> np.ndarray:
    """The values' bit patterns, as unsigned integers of their width."""
    return values.view(f"u{values.dtype.itemsize}")


def torch_bits(values: torch.Tensor) -> np.ndarray:
    """A tensor's bit patterns (numpy has no bfloat16: read through an integer view)."""
    integer = torch_dtype(f"int{8 * values.element_size()}")
    return bits(values.contiguous().view(integer).numpy())
