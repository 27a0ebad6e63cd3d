"""The dtypes the server knows: the rows of the project's one table
(``tokembed.export.dtypes``), and which of them it serves.

Every place in the server asks here: validation (which ids and answers a request may ask
for), the backends (what to cast rows to), the table budgets (each table's width), the
front ends (their wire names are derived from ``name``: tokembed.v1's ``DTYPE_<NAME>``,
the Open Inference Protocol's ``v2`` datatype). The rows themselves live with the model
directory's contract, which the exporter shares and the server may import, so that the
two never keep a table each. Adding an answer dtype is a row there, its enum value in the
proto, and a row in the client's table (``tokembed.client.dtypes``).
"""

from __future__ import annotations

from tokembed.export.dtypes import (
    ANSWER_DTYPES,
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    INT32,
    INT64,
    WEIGHT_DTYPES,
    DType,
)

__all__ = [
    "BFLOAT16", "FLOAT16", "FLOAT32", "ID_DTYPES", "INT32", "INT64", "OUTPUT_DTYPES",
    "WEIGHT_DTYPES", "DType",
]  # fmt: skip

# What an answer may be asked for. float32 is what a model computes; every other row is
# the float32 rows rounded to nearest even (``backends.sessions.output_casts``), once per
# table or answer: what torch's ``.to(dtype)`` of the float32 answer gives, and for a
# table stored in that dtype, torch's ``embedding(ids) * scale`` computed in it.
OUTPUT_DTYPES: dict[str, DType] = ANSWER_DTYPES
# What ids may be sent as.
ID_DTYPES: dict[str, DType] = {dtype.name: dtype for dtype in (INT64, INT32)}
