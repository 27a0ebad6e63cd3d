"""The one table of dtypes the client knows: a dtype is a row (its name, its wire enum,
its numpy type, its Open Inference Protocol name). The codec, the decoder, the results and
the shared-memory session ask it; adding an answer dtype is a row here (and its enum value
in the proto, and a row in the server's table).

bfloat16 answers are ``ml_dtypes.bfloat16`` arrays (numpy has no bfloat16). ml_dtypes is
imported the first time a bfloat16 row's numpy type is asked for, not with the client:
its import takes far longer than the client's own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from tokembed.v1 import embedding_pb2 as pb


@dataclass(frozen=True)
class DType:
    name: str
    wire: pb.DType.ValueType
    itemsize: int
    # numpy's name of the type, little-endian (the wire's byte order): "<f4"; or
    # "bfloat16", ml_dtypes' type.
    numpy_name: str
    # The Open Inference Protocol's name of the type (its tensors' ``datatype``).
    v2: str

    @functools.cached_property
    def numpy(self) -> np.dtype[Any]:
        """The numpy type (a plain attribute once read: cached on the row)."""
        if self.numpy_name == "bfloat16":
            import ml_dtypes

            bfloat16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
            return bfloat16
        return np.dtype(self.numpy_name)


INT64 = DType("int64", pb.DTYPE_INT64, 8, "<i8", "INT64")
INT32 = DType("int32", pb.DTYPE_INT32, 4, "<i4", "INT32")
FLOAT32 = DType("float32", pb.DTYPE_FLOAT32, 4, "<f4", "FP32")
FLOAT16 = DType("float16", pb.DTYPE_FLOAT16, 2, "<f2", "FP16")
BFLOAT16 = DType("bfloat16", pb.DTYPE_BFLOAT16, 2, "bfloat16", "BF16")

# The names an answer may be asked for by (for type checkers; the table below decides).
OutputName = Literal["float32", "float16", "bfloat16"]
# What answers may be asked for, by name (which is also their numpy type's name); and
# every dtype a tensor may carry, by enum.
OUTPUT: dict[str, DType] = {dtype.name: dtype for dtype in (FLOAT32, FLOAT16, BFLOAT16)}
BY_WIRE: dict[int, DType] = {
    dtype.wire: dtype for dtype in (INT64, INT32, FLOAT32, FLOAT16, BFLOAT16)
}


def name_of(wire: int) -> str:
    """A ``DType`` enum value's name ("float32", ...); unknown ones verbatim."""
    dtype = BY_WIRE.get(wire)
    return dtype.name if dtype is not None else f"dtype({wire})"
