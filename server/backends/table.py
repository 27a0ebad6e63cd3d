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

A look-up makes no array and copies nothing: its rows are views of the table, one per
id, which whoever writes the answer copies once, straight from the table (a response's
join); a shared-memory region's writer has them gathered in cache-sized runs instead
(``RowViews.gather``: the kernel's copy into the region is then from the cache, not from
rows scattered over the table). The views are made once, at load (a
Python object per row of each table kept, a few hundred bytes beside the row's ``D *
itemsize``), so that a look-up only picks them by id: slicing each row per request cost
more than the rest of a large look-up, and a numpy gather into an array copied the whole
answer once before its writer copied it again (docs/benchmarks/README.md has the figures).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from tokembed.server.backends.base import ArrayRows, Backend, LookUp, Rows, byte_view
from tokembed.server.backends.sessions import Cast, ModelSession
from tokembed.server.core.dtypes import FLOAT32, OUTPUT_DTYPES, DType
from tokembed.server.core.types import Buffer, GatherableRows, TokenIds

# From this many ids on, numpy works on them as an array (a gather into one array of
# their own, ``TableRows.joined``; a segment model's row numbers) rather than as ints.
GATHER_MIN_ROWS = 1024


class TableRows(Rows):
    """Rows as views of a table's rows (each view keeps the table alive)."""

    __slots__ = ("_ids", "_rows", "_views")

    def __init__(self, views: list[memoryview], rows: np.ndarray, ids: TokenIds) -> None:
        """``views``: the table's row views by id; ``rows``: the table as one opaque
        ``[V]`` item per row (numpy's gather, ``joined``)."""
        self._views = views
        self._rows = rows
        self._ids = ids

    def pieces(self, start: int, stop: int) -> Sequence[Buffer]:
        ids = self._ids.values()
        if start or stop < len(ids):
            return RowViews(self._views, ids[start:stop], self._rows, self._ids, start)
        return RowViews(self._views, ids, self._rows, self._ids, 0)

    def joined(self) -> Buffer:
        ids = self._ids
        if ids.count < GATHER_MIN_ROWS:
            return super().joined()
        # mode="clip": the ids are validated; unlike "raise" it writes straight into
        # ``out`` (no buffered second copy). numpy's gather lets go of the GIL.
        out = np.empty(ids.count, dtype=self._rows.dtype)
        self._rows.take(ids.array(), out=out, mode="clip")
        return byte_view(out)

    def __len__(self) -> int:
        return self._ids.count


class RowViews(GatherableRows):
    """The views of rows ``ids``, each looked up as it is read: a large answer's writer
    then touches each view's object once, as it copies the row, rather than once more
    beforehand to list them (the objects are scattered and cold: each touch is a cache
    miss). Or some of the same rows gathered by numpy (``gather``)."""

    __slots__ = ("_first", "_ids", "_rows", "_source", "_views")

    def __init__(
        self, views: list[memoryview], ids: list[int], rows: np.ndarray, source: TokenIds,
        first: int,
    ) -> None:  # fmt: skip
        """``ids``: ``source``'s values from its ``first`` on; ``rows``: the table as one
        opaque item per row (``TableRows``)."""
        self._views = views
        self._ids = ids
        self._rows = rows
        self._source = source
        self._first = first

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, index: int) -> Buffer: ...

    @overload
    def __getitem__(self, index: slice) -> list[Buffer]: ...

    def __getitem__(self, index: int | slice) -> Buffer | list[Buffer]:
        if isinstance(index, slice):
            return list(map(self._views.__getitem__, self._ids[index]))
        return self._views[self._ids[index]]

    def __iter__(self) -> Iterator[Buffer]:
        return map(self._views.__getitem__, self._ids)

    @property
    def row_bytes(self) -> int:
        return int(self._rows.itemsize)

    def gather(self, start: int, into: memoryview) -> memoryview:
        row_bytes = self.row_bytes
        count = max(0, min(into.nbytes // row_bytes, len(self._ids) - start))
        first = self._first + start
        ids = self._source.array()[first : first + count]
        out = np.frombuffer(into, dtype=self._rows.dtype, count=count)
        # mode="clip": the ids are validated; unlike "raise" it writes straight into
        # ``out`` (as in ``TableRows.joined``).
        self._rows.take(ids, out=out, mode="clip")
        return into[: count * row_bytes]


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
        kept (in memory, or mapped read-only from a file), float32 among them unless
        ``session`` is given; ``casts``: how to cast float32 rows to the other dtypes
        (answers in a dtype without a table are cast per answer). ``session``: the model,
        whose run gives the float32 rows of an answer in a dtype without a table when
        there is no float32 table; ``mapped_bytes``: the weights onnxruntime maps for it
        (reported, not allocated)."""
        if FLOAT32 not in tables and session is None:
            raise ValueError("this is a bug: without a float32 table the model must run")
        for table in tables.values():
            if table.ndim != 2 or not table.flags.c_contiguous:
                raise ValueError("this is a bug: a row table is a C-contiguous [V, D] array")
            table.flags.writeable = False  # answers are views of it
        self._tables = tables
        self._views = {dtype: _row_views(table) for dtype, table in tables.items()}
        # Each table as one opaque row per id, for numpy's gather (``TableRows.joined``).
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
        """Bytes of each table kept, by dtype name, a table mapped from a file (the table
        cache's, which processes serving the same model share) as a "mapped" one; and of
        the weights onnxruntime maps when the model runs for some answers. A mapped table
        counts whole here, as what this process holds: how much of it another process
        holds as well is the kernel's to say (PSS)."""
        held = {
            f"{'mapped ' if _is_mapped(table) else ''}{dtype.name} table": int(table.nbytes)
            for dtype, table in self._tables.items()
        }
        if self._session is not None:
            held["weights mapped by onnxruntime"] = self._mapped_bytes
        return held

    def held_table(self, dtype_name: str) -> np.ndarray | None:
        for dtype, table in self._tables.items():
            if dtype.name == dtype_name:
                return table
        return None

    def look_up(self, request: LookUp) -> Rows:
        ids, dtype = request.ids, request.dtype
        views = self._views.get(dtype)
        if views is not None:
            return TableRows(views, self._rows[dtype], ids)
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


def _is_mapped(table: np.ndarray) -> bool:
    """Whether ``table`` is a view of a file's mapping rather than memory of its own."""
    base: object = table
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):  # numpy's view of a buffer (np.frombuffer)
        base = base.obj
    return isinstance(base, mmap.mmap)


def _row_views(table: np.ndarray) -> list[memoryview]:
    """A ``[V, D]`` table's rows, each as a view of its bytes."""
    data = byte_view(table)
    size = table.shape[1] * table.itemsize
    return [data[start : start + size] for start in range(0, len(data), size)]
