"""Answers gathered from a row table straight into the array that holds them (in-place
answers: their response bytes, or an EmbedChunked answer's array), the copying shared
with one helper thread when it is large.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from tokembed.server.batcher import BatchResult
from tokembed.server.domain import FLAT, EmbedJob

# In-place gathers of at least this many bytes are shared between two threads. A live
# gather runs at cold caches and is bound by what one core can move: a [32,512] answer
# (33.5 MB) took 4.8 ms on one thread and 2.5 ms on two here (caches flushed before
# each), and at low load the second core is idle. Below this the hand-off eats the gain.
SPLIT_GATHER_MIN_BYTES = 4 << 20


class GatherHelper:
    """One thread that takes half of a large gather when it is free. A second gather at
    the same time would only queue behind the first's half, so it does all of its own
    copying instead."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokembed-gather")
        self._free = threading.Semaphore(1)

    def try_submit(self, fn: Callable[..., None], *args: object) -> Future[None] | None:
        """``fn(*args)`` on the helper thread, or None (and nothing run) if it is busy."""
        if not self._free.acquire(blocking=False):
            return None

        def share() -> None:
            try:
                fn(*args)
            finally:
                # Free before the future completes: whoever waits on it finds the
                # helper free for its next gather.
                self._free.release()

        try:
            return self._executor.submit(share)
        except BaseException:
            self._free.release()
            raise

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False)


_Pieces = list[tuple[np.ndarray, np.ndarray]]  # (ids, the output rows they fill)


def gather_into(
    table: np.ndarray,
    job: EmbedJob,
    out: np.ndarray,
    pad_row: np.ndarray,
    helper: GatherHelper | None = None,
) -> BatchResult:
    """The answer's rows from ``table``, written into ``out``: ``out[i] = table[ids[i]]``,
    or for padded ragged answers each sequence's rows then pad rows. The rows are copied
    as opaque bytes. With a ``helper``, it does half of the copying meanwhile.

    Why bytes: ``out`` may sit at any offset (in the response bytes, the rows follow the
    protobuf header), and numpy copies into an unaligned float32 output through an
    aligned temporary: 19 ms instead of 6 ms for 33.5 MB here. Rows of raw bytes need
    no alignment.
    """
    if not out.flags.c_contiguous:  # reshape would copy, and the answer stay unwritten
        raise ValueError("this is a bug: an answer array to fill must be C-contiguous")
    started = time.monotonic()
    d_model = table.shape[1]
    row = np.dtype((np.void, d_model * table.itemsize))
    source = table.view(row).reshape(table.shape[0])
    # What to copy: pieces of ids and the output rows they fill, and where pad rows go.
    pieces: _Pieces = []
    pads: list[np.ndarray] = []
    if job.ragged and job.layout != FLAT:
        assert job.lengths is not None
        sequences = out.reshape(job.batch, job.seq_len * d_model).view(row)  # [B, S] rows
        offset = 0
        for sequence, length in zip(sequences, job.lengths, strict=True):
            pieces.append((job.ids[offset : offset + length], sequence[:length]))
            pads.append(sequence[length:])
            offset += length
    else:
        rows = out.reshape(job.tokens, d_model).view(row).reshape(job.tokens)  # views
        pieces.append((job.ids, rows))
    pad = np.ascontiguousarray(pad_row.astype(table.dtype)).view(row)[0]
    shared = None
    if helper is not None:
        (mine, my_pads), (theirs, their_pads) = _split_in_two(pieces, pads)
        shared = helper.try_submit(_copy_rows, source, theirs, their_pads, pad)
    if shared is None:
        _copy_rows(source, pieces, pads, pad)
    else:
        try:
            _copy_rows(source, mine, my_pads, pad)
        finally:
            shared.result()  # never return (or raise) while the helper still writes
    return BatchResult(out, 0.0, time.monotonic() - started, 1, job.tokens)


def _copy_rows(source: np.ndarray, pieces: _Pieces, pads: list[np.ndarray], pad: np.void) -> None:
    for ids, rows in pieces:
        # mode="clip": the ids are validated already, so it clips nothing, and unlike the
        # default "raise" it writes straight into ``rows`` (no buffered second copy).
        source.take(ids, out=rows, mode="clip")
    for rows in pads:
        rows[...] = pad


def _split_in_two(
    pieces: _Pieces, pads: list[np.ndarray]
) -> tuple[tuple[_Pieces, list[np.ndarray]], tuple[_Pieces, list[np.ndarray]]]:
    """Two shares of the copying: one piece is cut at its middle row; several (one per
    sequence of a padded answer, each with its pad rows) are dealt by count, the first
    half of the sequences and the rest (uneven when their lengths are)."""
    if len(pieces) == 1:
        ids, rows = pieces[0]
        half = len(ids) // 2
        return ([(ids[:half], rows[:half])], pads), ([(ids[half:], rows[half:])], [])
    half = len(pieces) // 2
    return (pieces[:half], pads[:half]), (pieces[half:], pads[half:])
