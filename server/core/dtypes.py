"""The one table of dtypes the server knows: a dtype is a row.

Every other place asks this table: validation (which ids and answers a request may ask
for), the backends (what to cast rows to), the front ends (their wire names are derived
from ``name``: tokembed.v1's ``DTYPE_<NAME>``, the Open Inference Protocol's ``v2``
datatype). Adding an answer dtype is a row here, its enum value in the proto, and a row
in the client's table (``tokembed.client.dtypes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np


# eq=False: a row is its own identity (the rows below are the only ones), so tables keyed by
# a DType hash it as any object, with no code of this module run per look-up.
@dataclass(frozen=True, eq=False)
class DType:
    name: str  # as requests, manifests, metrics and logs name it
    numpy: np.dtype  # little-endian: the wire's byte order
    v2: str  # the Open Inference Protocol's datatype name
    itemsize: int = field(init=False, compare=False)  # read per request: a plain int

    def __post_init__(self) -> None:
        object.__setattr__(self, "itemsize", int(self.numpy.itemsize))


FLOAT32 = DType("float32", np.dtype("<f4"), "FP32")
FLOAT16 = DType("float16", np.dtype("<f2"), "FP16")
# ml_dtypes' type (onnx's too): numpy has none. Its values are stored in native order,
# little-endian on every machine the server runs on.
BFLOAT16 = DType("bfloat16", np.dtype(ml_dtypes.bfloat16), "BF16")
INT64 = DType("int64", np.dtype("<i8"), "INT64")
INT32 = DType("int32", np.dtype("<i4"), "INT32")

# What an answer may be asked for. float32 is what a model computes; every other row is
# the float32 rows rounded to nearest even (``backends.sessions.output_casts``), once per
# table or answer: what torch's ``.to(dtype)`` of the float32 answer gives, and for a
# table stored in that dtype, torch's ``embedding(ids) * scale`` computed in it.
OUTPUT_DTYPES: dict[str, DType] = {dtype.name: dtype for dtype in (FLOAT32, FLOAT16, BFLOAT16)}
# What ids may be sent as.
ID_DTYPES: dict[str, DType] = {dtype.name: dtype for dtype in (INT64, INT32)}
