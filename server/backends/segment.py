"""A segment model (BERT's ``E[id] * scale + S[t]``) served from a table of every (id, type)
combination: ``T * V`` rows, row ``t * V + id``, each computed by the model at load.

Why every combination, and not ``E * scale`` and ``S`` kept apart and added per request:
the rows are then the model's own output (its session ran over every id with each type),
so answers are bit-identical to a run of the model by construction, and a look-up is the
table backend's, with its float16 tables, its views of the rows and its padding rows.
Adding per request costs a second pass over the answer's bytes: in numpy (at BERT-base's
sizes), a gather, a gather of the type rows and an add took longer than one gather from
the combined table, for few ids and for many (numpy's gather from a table of 2 rows is
slow). The price is memory, T times a token model's table; where that is over
``--float32-table-max-bytes`` the model runs per batch instead (the onnxruntime backend),
and that graph is the gather-and-add.
"""

from __future__ import annotations

import numpy as np

from tokembed.server.backends.base import Backend, LookUp, Rows
from tokembed.server.backends.sessions import ModelSession
from tokembed.server.backends.table import GATHER_MIN_ROWS, TableBackend
from tokembed.server.core.dtypes import INT64, DType
from tokembed.server.core.types import TokenIds


class SegmentTableBackend(Backend):
    """Look-ups of ``(id, type)`` as rows ``type * V + id`` of a table backend's tables."""

    kind = "table"

    def __init__(self, table: TableBackend, vocab_size: int, types_input: str) -> None:
        """``table``: a table backend over ``[T * V, D]`` rows; ``types_input``: the name
        of the type ids in a ``LookUp``'s ``more`` (``token_type_ids``)."""
        self._table = table
        self._vocab_size = vocab_size
        self._types_input = types_input
        self.d_model = table.d_model
        self.execution_provider = table.execution_provider

    @property
    def memory_bytes(self) -> dict[str, int]:
        return self._table.memory_bytes

    def look_up(self, request: LookUp) -> Rows:
        ids, types = request.ids, request.more.get(self._types_input)
        if types is None:  # no types sent (or the server's own look-ups): type 0, rows [0, V)
            return self._table.look_up(LookUp(ids, request.dtype))
        vocab_size = self._vocab_size
        if ids.count >= GATHER_MIN_ROWS:
            rows = ids.array() + types.array() * vocab_size
            combined = TokenIds(rows.astype(INT64.numpy, copy=False).tobytes(), INT64, ids.count)
        else:
            # Python ints for a small request: the table slices its rows by them.
            combined = TokenIds.of(
                [i + t * vocab_size for i, t in zip(ids.values(), types.values(), strict=True)]
            )
        return self._table.look_up(LookUp(combined, request.dtype))

    def pad_row(self, dtype: DType) -> bytes:
        # The padding id's row with type 0 (row padding_id of the table): what the model
        # computes for padding when no type is given.
        return self._table.pad_row(dtype)

    def close(self) -> None:
        self._table.close()


def every_combination(
    session: ModelSession, type_vocab_size: int, types_input: str, chunk_bytes: int
) -> np.ndarray:
    """float32 ``[T * V, D]``: the model's row of each id with each type, row ``t * V + id``,
    computed ``chunk_bytes`` of rows at a time."""
    vocab_size, d_model = session.vocab_size, session.d_model
    table = np.empty((type_vocab_size * vocab_size, d_model), dtype=np.float32)
    for type_id in range(type_vocab_size):
        rows = table[type_id * vocab_size : (type_id + 1) * vocab_size]
        session.rows_into(rows, chunk_bytes, constants={types_input: type_id})
    return table
