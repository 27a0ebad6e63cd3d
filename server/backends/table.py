"""The table backend: every row computed by the model once, at load; look-ups slice them.

Why: a gather from a table measured faster than the onnxruntime run of the same ids, for
few ids and for many (the graph gathers, then scales: two passes over the rows, and the
answer is copied out of onnxruntime), and inside a busy server a tiny request's
onnxruntime call costs more CPU than its work. The tables are the model's own output (its
session runs over the whole vocabulary at load), so answers are bit-identical to a run of
the model; the float16 and bfloat16 tables are that output cast once with the same cast an
answer would take.
Answers in a dtype without a table are the float32 rows cast per answer: sliced from the
float32 table, or, for a model stored in bfloat16 (which keeps no float32 table: it would
double the model's memory), a run of the model (``settings.Settings.tables`` decides).

A small look-up makes no array at all: its rows are slices of the table's bytes, which
whoever writes the answer joins into the response, copying each row once. For a tiny
request numpy's per-call machinery was most of the look-up. From ``GATHER_MIN_ROWS`` rows
on, numpy gathers them into one array instead: a slice costs Python per row, holding the
GIL, and joining thousands of them costs more than one array of the same bytes, where
numpy's gather releases the GIL and the join copies one piece.
"""

from __future__ import annotations

import numpy as np

from tokembed.server.backends.base import ArrayRows, Backend, LookUp, Rows, byte_view
from tokembed.server.backends.sessions import Cast, ModelSession
from tokembed.server.core.dtypes import FLOAT32, OUTPUT_DTYPES, DType
from tokembed.server.core.types import Buffer, TokenIds

# Look-ups of this many rows and more are gathered by numpy into an array (see above).
GATHER_MIN_ROWS = 1024


class TableRows(Rows):
    """Rows as slices of a table's bytes (a memoryview keeps the table alive)."""

    __slots__ = ("_ids", "_row_bytes", "_table")

    def __init__(self, table: memoryview, row_bytes: int, ids: list[int]) -> None:
        self._table = table
        self._row_bytes = row_bytes
        self._ids = ids

    def pieces(self, start: int, stop: int) -> list[Buffer]:
        table, size = self._table, self._row_bytes
        return [table[i * size : (i + 1) * size] for i in self._ids[start:stop]]

    def __len__(self) -> int:
        return len(self._ids)


class TableBackend(Backend):
    kind = "table"

    def __init__(
        self,
        tables: dict[DType, np.ndarray],
        *,
        casts: dict[DType, Cast],
        padding_id: int | None,
        execution_provider: str,
        session: ModelSession | None = None,
        mapped_bytes: int = 0,
    ) -> None:
        """``tables``: the model's ``[V, D]`` rows in each output dtype whose table is
        kept, float32 among them unless ``session`` is given; ``casts``: how to cast
        float32 rows to the other dtypes (answers in a dtype without a table are cast per
        answer). ``session``: the model, whose run gives the float32 rows of an answer in
        a dtype without a table when there is no float32 table; ``mapped_bytes``: the
        weights onnxruntime maps for it (reported, not allocated)."""
        if FLOAT32 not in tables and session is None:
            raise ValueError("this is a bug: without a float32 table the model must run")
        for table in tables.values():
            if table.ndim != 2 or not table.flags.c_contiguous:
                raise ValueError("this is a bug: a row table is a C-contiguous [V, D] array")
            table.flags.writeable = False  # answers are views of it
        self._tables = tables
        self._bytes = {dtype: byte_view(table) for dtype, table in tables.items()}
        # Each table as one opaque row per id, for numpy's gather of large answers.
        self._rows = {
            dtype: table.view(np.dtype((np.void, table.shape[1] * table.itemsize))).reshape(-1)
            for dtype, table in tables.items()
        }
        self.d_model = int(next(iter(tables.values())).shape[1])
        self.execution_provider = execution_provider
        self._casts = casts
        self._session = session
        self._mapped_bytes = mapped_bytes
        self._pad_rows = {
            dtype: bytes(self.d_model * dtype.itemsize)
            if padding_id is None
            else self._one_row(padding_id, dtype)
            for dtype in OUTPUT_DTYPES.values()
        }

    @property
    def memory_bytes(self) -> dict[str, int]:
        """Bytes of each table kept, by dtype name (and of the weights onnxruntime maps
        when the model runs for some answers)."""
        held = {f"{dtype.name} table": int(table.nbytes) for dtype, table in self._tables.items()}
        if self._session is not None:
            held["weights mapped by onnxruntime"] = self._mapped_bytes
        return held

    def look_up(self, request: LookUp) -> Rows:
        ids, dtype = request.ids, request.dtype
        table = self._bytes.get(dtype)
        if table is not None:
            if ids.count >= GATHER_MIN_ROWS:
                rows = self._rows[dtype]
                out = np.empty(ids.count, dtype=rows.dtype)
                # mode="clip": the ids are validated; unlike "raise" it writes straight
                # into ``out`` (no buffered second copy).
                rows.take(ids.array(), out=out, mode="clip")
                return ArrayRows(out.view(dtype.numpy).reshape(ids.count, self.d_model))
            return TableRows(table, self.d_model * dtype.itemsize, ids.values())
        # No table of this dtype: the float32 rows, cast as the table would have been.
        if self._session is None:
            rows = self._tables[FLOAT32].take(ids.array(), axis=0)
        else:
            rows = self._session.run(ids.array())
        return ArrayRows(rows if dtype == FLOAT32 else self._casts[dtype](rows))

    def pad_row(self, dtype: DType) -> bytes:
        return self._pad_rows[dtype]

    def _one_row(self, index: int, dtype: DType) -> bytes:
        rows = self.look_up(LookUp(TokenIds.of([index]), dtype))
        return b"".join(rows.pieces(0, 1))
