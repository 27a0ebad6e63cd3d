"""Arrays that mid-size EmbedChunked answers are gathered into, kept to be filled again.

Why: an EmbedChunked answer is gathered into an array of its own (the chunks are cut
from it) and freed once its last chunk is sent. At concurrency 8, answers of 8-16 MiB
come from glibc's heap, and each lands on pages that the server's heap trim gave back
meanwhile, so the kernel faults them in again; the heap spreads over several times what
is live, and resident memory climbs 100-180 MB above idle within a second of load
(docs/benchmarks/README.md, "Sixth round"). A kept array stays on its pages.

Only answers below glibc's largest mmap threshold (32 MiB) are kept: smaller blocks
freed into the heap keep their pages until the next trim anyway, so keeping them for the
next answer costs little beyond that, while larger ones are unmapped at once when freed,
and keeping one would hold memory that nothing is using.

When an array may be filled again: only its slot refers to it. The answer handed out
is a view of it, the chunks cut from the answer are views of that, and a gather still
running on a worker thread holds the answer too: while any of them is alive, the array
is not reused. No explicit give-back, so no path (a cancelled stream, an error between
two chunks) can return an array that someone still reads.

Memory: the arrays in use are answers in flight (which admission bounds). When an
answer finds no free array of its size, the free arrays of other sizes are let go before
a new one is made, and ``release_idle``, called with every heap trim, lets go of each
free array that no answer took since the previous call: a burst leaves none behind
after two trims. Answers whose sizes keep changing (mixed shapes) gain nothing: each
gets a new array, as it would without these.
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np

# glibc's largest dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): blocks
# this size and up are always mmap'd, and unmapped when freed.
KEEP_BELOW_BYTES = 32 * 1024 * 1024


class _Slot:
    __slots__ = ("array", "taken")

    def __init__(self, array: np.ndarray) -> None:
        self.array = array  # flat bytes (uint8): any dtype and shape of this size is a view
        self.taken = True  # whether an answer took it since the last release_idle

    def is_free(self) -> bool:
        return self.refcount() == _HELD_BY_ITS_SLOT_ALONE

    def refcount(self) -> int:
        return sys.getrefcount(self.array)


class AnswerArrays:
    """Hands out arrays to gather answers into, reusing those nobody holds any more."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the heap trim calls release_idle from a thread
        self._slots: list[_Slot] = []

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised array of ``shape`` and ``dtype`` (as ``np.empty``), reusing
        a free kept one of the same size when there is one (below ``KEEP_BELOW_BYTES``;
        larger ones are new and not kept)."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes >= KEEP_BELOW_BYTES:
            return np.empty(shape, dtype=dtype)
        with self._lock:
            for slot in self._slots:
                if slot.array.nbytes == nbytes and slot.is_free():
                    slot.taken = True
                    return slot.array.view(dtype).reshape(shape)
            # None of this size is free: let free ones of other sizes go first.
            self._slots = [s for s in self._slots if s.array.nbytes == nbytes or not s.is_free()]
            slot = _Slot(np.empty(nbytes, dtype=np.uint8))
            self._slots.append(slot)
            return slot.array.view(dtype).reshape(shape)

    def release_idle(self) -> None:
        """Let go of each free array that no answer took since the last call."""
        with self._lock:
            self._slots = [s for s in self._slots if s.taken or not s.is_free()]
            for slot in self._slots:
                slot.taken = False

    def release(self) -> None:
        """Let go of every free array now (at shutdown)."""
        with self._lock:
            self._slots = [s for s in self._slots if not s.is_free()]

    @staticmethod
    def reusable() -> bool:
        """Whether arrays may be kept and reused on this interpreter (checked once)."""
        return _REUSABLE

    @property
    def held_bytes(self) -> int:
        """Bytes of the arrays kept, in use or not."""
        with self._lock:
            return sum(s.array.nbytes for s in self._slots)


def _refcount_held_by_a_slot_alone() -> int:
    """What ``_Slot.is_free`` reads when only the slot refers to its array, taken the
    same way (the count getrefcount adds for itself varies between versions)."""
    return _Slot(np.empty(1, dtype=np.uint8)).refcount()


_HELD_BY_ITS_SLOT_ALONE = _refcount_held_by_a_slot_alone()


def _reuse_self_check() -> bool:
    """Whether the rules hold on this interpreter (refcounts are an implementation
    detail): an array in use is not handed out again, nor one that only a chunk cut from
    its answer still reads, and a free one is."""
    try:
        arrays = AnswerArrays()
        shape, dtype = (4, 4), np.dtype(np.float32)
        held = arrays.take(shape, dtype)
        second = arrays.take(shape, dtype)
        if np.shares_memory(held, second):
            return False
        chunk = held.data.cast("B")[:16]
        address = held.__array_interface__["data"][0]
        del held
        third = arrays.take(shape, dtype)
        if third.__array_interface__["data"][0] == address or np.shares_memory(third, second):
            return False
        del chunk
        return bool(arrays.take(shape, dtype).__array_interface__["data"][0] == address)
    except Exception:  # any failure means: do not keep arrays here
        return False


_REUSABLE = _reuse_self_check()
