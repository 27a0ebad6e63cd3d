"""A new ``bytes`` object whose contents are written after it is created.

Why: gRPC's Python API sends only ``bytes``, so a large answer used to exist as the
look-up's rows, then as the response bytes joined from them (a second full copy, in
fresh zero-filled pages), then as gRPC's own copy. Writing the rows straight into the
response bytes removes the middle copy: one [32,512] x 512 float32 answer took ~16 ms
to build and hand over instead of ~21 ms here, and is resident twice at most, not
three times.

How, and why it is safe: ``PyBytes_FromStringAndSize(NULL, n)`` is CPython's public way
to create a bytes object to fill in (C extensions do exactly this); its characters
start at a fixed offset in the object. Nothing else holds the object or has hashed it
while it is filled, and the writable view is dropped (made read-only) before the bytes
leave. A self-check at import writes through the view and reads the bytes back; on an
interpreter where that does not hold, ``available()`` is False and callers copy as
before.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

# CPython's PyBytesObject: the variable-size header and the cached hash, then the
# characters (ob_sval), whose first byte is counted in the basic size.
_CHARS_OFFSET = bytes.__basicsize__ - 1
# The cached hash (ob_shash): -1 until someone hashes the bytes.
_HASH_OFFSET = _CHARS_OFFSET - ctypes.sizeof(ctypes.c_ssize_t)


def _bytes_constructor() -> Any:
    new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
    new_bytes.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
    new_bytes.restype = ctypes.py_object
    return new_bytes


class _CharsOf:
    """The characters of a bytes object as numpy's writable memory. Every array made
    from it keeps this object, and so the bytes, alive."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.__array_interface__: dict[str, Any] = {
            "version": 3,
            "shape": (len(data),),
            "typestr": "|u1",
            "data": (id(data) + _CHARS_OFFSET, False),
        }


def allocate(size: int) -> tuple[bytes, np.ndarray]:
    """A new bytes object of ``size`` (contents undefined) and a writable uint8 view of
    it. Write every byte, then drop or freeze the view before the bytes are shared."""
    if size <= 0:
        raise ValueError(f"this is a bug: in-place bytes of size {size}")
    if _new_bytes is None:
        raise RuntimeError("this is a bug: in-place bytes used where available() is False")
    data: bytes = _new_bytes(None, size)
    return data, np.asarray(_CharsOf(data))


def _self_check() -> Any:
    """The constructor, if this interpreter lays bytes out as assumed; else None. Reads
    through the computed address before ever writing through it."""
    try:
        known = bytes(range(256)) * 4
        if ctypes.string_at(id(known) + _CHARS_OFFSET, len(known)) != known:
            return None
        new_bytes = _bytes_constructor()
        data: bytes = new_bytes(None, 64)
        view = np.asarray(_CharsOf(data))
        view[:] = np.arange(64, dtype=np.uint8)
        return new_bytes if data == bytes(range(64)) else None
    except Exception:  # any failure means: do not use it here
        logger.debug("in-place bytes unavailable", exc_info=True)
        return None


_new_bytes = _self_check()


def available() -> bool:
    """Whether ``allocate`` may be used here; where not, callers copy as before."""
    return _new_bytes is not None


def _never_hashed(data: bytes) -> bool:
    return _hash_slot(data) == -1


class SpareBytes:
    """Keeps the bytes of the latest in-place answer, to fill again for the next answer
    of the same size once nobody holds them any more.

    Why: fresh bytes of 32 MiB are fresh pages, which the kernel zero-fills one by one
    as the look-up first writes them; the floor's answer, cached, pays none of that.
    A fixed-shape workload asks for answers of one size, so at concurrency 1 most
    answers reuse the spare (not when the next request comes before gRPC is done with
    the last answer). Measured, large [32,512] unary at c=1: docs/benchmarks/README.md.

    When a spare may be filled again: only its holder refers to it (gRPC copies the
    bytes when it starts sending and drops them once sent; a view, a traceback, anyone
    holding them: not reused) and nobody has hashed it (the cached hash would go stale).

    Memory: at most one answer is kept beyond those in flight, and not for long: a free
    spare is let go before bytes of another size are allocated, and by ``release_idle``
    when no answer asked for bytes since its previous call (the server's heap trim calls
    it every second, so an idle server holds none after two seconds).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the heap trim runs on another thread
        self._spare: bytes | None = None
        self._taken = False  # whether an answer asked for bytes since release_idle

    def allocate(self, size: int) -> tuple[bytes, np.ndarray]:
        """As :func:`allocate`, reusing the spare when it is free and of this size."""
        with self._lock:
            self._taken = True
            if self._spare_is_free():
                assert self._spare is not None
                if len(self._spare) == size:
                    return self._spare, np.asarray(_CharsOf(self._spare))
                self._spare = None  # let it go first: one answer at a time
            data, view = allocate(size)
            self._spare = data
            return data, view

    @property
    def held_bytes(self) -> int:
        """The size of the spare kept (0: none), in use or not."""
        spare = self._spare
        return 0 if spare is None else len(spare)

    def release_idle(self) -> None:
        """Let the spare go if no answer asked for bytes since the last call and none is
        using it: a spare in steady use stays, an idle one goes."""
        with self._lock:
            if not self._taken and self._spare_is_free():
                self._spare = None
            self._taken = False

    def release(self) -> None:
        """Let the spare go now, unless an answer is using it (at shutdown)."""
        with self._lock:
            if self._spare_is_free():
                self._spare = None

    def _spare_is_free(self) -> bool:
        if self._spare is None:
            return False
        return self._spare_refcount() == _SPARE_HELD_ALONE and _never_hashed(self._spare)

    def _spare_refcount(self) -> int:
        return sys.getrefcount(self._spare)


def _refcount_of_a_spare_held_alone() -> int:
    """What ``_spare_refcount`` reads when the holder alone refers to the spare, taken
    the same way (the count getrefcount adds for itself varies between versions)."""
    holder = SpareBytes()
    holder._spare = bytes(range(256)) * 2  # a new object: nothing else refers to it
    return holder._spare_refcount()


def _reuse_self_check() -> bool:
    """Whether the spare's rules hold on this interpreter: the cached hash reads as
    expected, a held spare is not reused, a free one is, a hashed one is not."""
    if not available():
        return False
    try:
        fresh = bytes(range(256)) * 2
        if _hash_slot(fresh) != -1 or hash(fresh) != _hash_slot(fresh):
            return False
        spare = SpareBytes()
        held, _ = spare.allocate(64)
        second = spare.allocate(64)[0]
        if second is held:  # we still hold the first: it must not come back
            return False
        second_id = id(second)
        del second  # now only the spare holds it
        third = spare.allocate(64)[0]
        if id(third) != second_id:  # it is still alive (the spare holds it): same object
            return False
        hash(third)
        third_id = id(third)
        del third
        return id(spare.allocate(64)[0]) != third_id  # hashed: not reused
    except Exception:  # any failure means: do not reuse here
        logger.debug("reusing in-place bytes unavailable", exc_info=True)
        return False


def _hash_slot(data: bytes) -> int:
    return ctypes.c_ssize_t.from_address(id(data) + _HASH_OFFSET).value


_SPARE_HELD_ALONE = _refcount_of_a_spare_held_alone()
_reusable = _reuse_self_check()


def reusable() -> bool:
    """Whether a :class:`SpareBytes` may be used here; where not, every answer gets
    fresh bytes."""
    return _reusable
