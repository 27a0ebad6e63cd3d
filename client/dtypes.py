"""The one table of dtypes the client knows: a dtype is a row (its name, its wire enum,
its numpy type). The codec, the decoder and the results ask it; adding an answer dtype
is a row here (and its enum value in the proto, and a row in the server's table)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from tokembed.v1 import embedding_pb2 as pb


@dataclass(frozen=True)
class DType:
    name: str
    wire: pb.DType.ValueType
    numpy: np.dtype[Any]  # little-endian: the wire's byte order

    @property
    def itemsize(self) -> int:
        return int(self.numpy.itemsize)


INT64 = DType("int64", pb.DTYPE_INT64, np.dtype("<i8"))
INT32 = DType("int32", pb.DTYPE_INT32, np.dtype("<i4"))
FLOAT32 = DType("float32", pb.DTYPE_FLOAT32, np.dtype("<f4"))
FLOAT16 = DType("float16", pb.DTYPE_FLOAT16, np.dtype("<f2"))

# The names an answer may be asked for by (for type checkers; the table below decides).
OutputName = Literal["float32", "float16"]
# What answers may be asked for, by name; and every dtype a tensor may carry, by enum.
OUTPUT: dict[str, DType] = {dtype.name: dtype for dtype in (FLOAT32, FLOAT16)}
BY_WIRE: dict[int, DType] = {dtype.wire: dtype for dtype in (INT64, INT32, FLOAT32, FLOAT16)}
# Answers by their numpy type's string ("<f4"): what an array's dtype says it is.
OUTPUT_BY_NUMPY: dict[str, DType] = {dtype.numpy.str: dtype for dtype in OUTPUT.values()}


def name_of(wire: int) -> str:
    """A ``DType`` enum value's name ("float32", ...); unknown ones verbatim."""
    dtype = BY_WIRE.get(wire)
    return dtype.name if dtype is not None else f"dtype({wire})"
