"""A registered shared-memory region and the windows requests use of it: copies by
``pread`` / ``pwrite`` / ``pwritev`` on the object's descriptor, never a mapping, each
checked against the object as it is at that moment. Why it is done this way: shm.py's docstring
(Security), which also says how regions are named and registered.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

from tokembed.server.core.errors import Cancelled, InvalidInput
from tokembed.server.core.types import Buffer, GatherableRows

# Buffers one pwritev takes (Linux: 1024); sysconf says -1 where it sets no limit.
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 0
_IOV_MAX = _IOV_MAX if _IOV_MAX > 0 else 1024
# Rows gathered per write call (``GatherableRows.gather``): small enough that the
# gathered run is still in the cache when the kernel copies it.
RUN_BYTES = 512 * 1024
# The second thread that gathers and writes runs of a large answer beside the one that
# frames it: one thread's gather overlaps the other's copy into the object (the kernel
# serialises the copies into one file, not the gathers). One per process, shared by
# every answer: a write whose helper is busy with another writes its runs itself until the
# helper is free.
_HELPER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokembed-shm-write")
_RUN_BUFFERS = threading.local()


class SharedMemoryError(InvalidInput):
    """A registration, or a request's use of a region, that cannot be honoured."""


@dataclass(frozen=True)
class RegionStatus:
    name: str
    key: str
    offset: int
    byte_size: int


class Region:
    """One registered window of a shared-memory object, and the descriptor it is read and
    written through."""

    def __init__(self, name: str, key: str, offset: int, byte_size: int, fd: int) -> None:
        self.name = name
        self.key = key
        self.offset = offset
        self.byte_size = byte_size
        self._fd = fd
        # Copies run on the loop and on worker threads; the descriptor is closed by
        # whichever of the last copy and the close comes later.
        self._lock = threading.Lock()
        self._copies = 0
        self._closed = False
        self._fd_open = True
        # Requests using the region (on the event loop alone). Once retired (unregistered)
        # the last of them closes it: the close does not depend on the unregistering call,
        # which may be cancelled while it waits.
        self.users = 0
        self._retired = False
        self._idle: asyncio.Event | None = None

    @property
    def status(self) -> RegionStatus:
        return RegionStatus(self.name, self.key, self.offset, self.byte_size)

    # --- the requests using it (event loop)

    def hold(self) -> None:
        self.users += 1

    def let_go(self) -> None:
        self.users -= 1
        if self.users == 0:
            if self._retired:
                self.close()
            if self._idle is not None:
                self._idle.set()

    def retire(self) -> None:
        """Unregistered: closed once no request uses it (now, or at the last ``let_go``)."""
        self._retired = True
        if self.users == 0:
            self.close()

    async def wait_unused(self) -> None:
        if self.users:
            self._idle = asyncio.Event()
            await self._idle.wait()

    @property
    def holds_descriptor(self) -> bool:
        """Its descriptor is not closed yet (a region unregistered may still hold it)."""
        with self._lock:
            return self._fd_open

    # --- copies (any thread)

    def read(self, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` of the window (both checked by the caller against
        the window; checked here against the object as it is now)."""
        fd = self._begin_copy()
        try:
            self._check_object(fd)
            data = os.pread(fd, size, self.offset + offset)
        except OSError as exc:
            raise SharedMemoryError(
                f"cannot read region {self.name!r}: {exc.strerror or exc}"
            ) from None
        finally:
            self._end_copy()
        if len(data) != size:  # the object shrank after the check: the read came up short
            raise SharedMemoryError(
                f"region {self.name!r} shrank while it was read ({len(data)} of {size} "
                "bytes); register it again"
            )
        return data

    def write(self, offset: int, pieces: Sequence[Buffer], nbytes: int) -> None:
        """The ``nbytes`` of ``pieces``, joined, at ``offset`` of the window (the caller
        checked that they fit it): rows of a table gathered in runs, a write call each,
        by two threads; other pieces straight from them, vectored."""
        fd = self._begin_copy()
        try:
            check = functools.partial(self._check_object, fd)
            if isinstance(pieces, GatherableRows):
                _pwrite_rows(fd, pieces, self.offset + offset, check)
            elif _pwrite_batches(fd, pieces, self.offset + offset, check) != nbytes:
                # A call wrote less than it was given (a signal, the file system full),
                # so the calls after it wrote at the wrong places: all again, resumed.
                _pwrite_all(fd, pieces, self.offset + offset, check)
        except OSError as exc:
            raise SharedMemoryError(
                f"cannot write region {self.name!r}: {exc.strerror or exc}"
            ) from None
        finally:
            self._end_copy()

    def _check_object(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        end = self.offset + self.byte_size
        if size < end:
            raise SharedMemoryError(
                f"region {self.name!r} is no longer what was registered: its object is now "
                f"{size} bytes, the window ends at byte {end}; register it again"
            )

    def _begin_copy(self) -> int:
        with self._lock:
            if self._closed:
                raise SharedMemoryError(f"region {self.name!r} was unregistered")
            self._copies += 1
            return self._fd

    def _end_copy(self) -> None:
        with self._lock:
            self._copies -= 1
            close = self._closed and self._copies == 0
        if close:
            self._close_descriptor()

    def close(self) -> None:
        """No more copies; the descriptor goes once the last one running has returned."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            close = self._copies == 0
        if close:
            self._close_descriptor()

    def _close_descriptor(self) -> None:
        os.close(self._fd)
        with self._lock:
            self._fd_open = False


class Window:
    """Part of a region one tensor of a request is read from or written into."""

    __slots__ = ("byte_size", "offset", "region")

    def __init__(self, region: Region, offset: int, byte_size: int) -> None:
        self.region: Region | None = region
        self.offset = offset
        self.byte_size = byte_size

    @property
    def name(self) -> str:
        return self._held().name

    def read(self, max_bytes: int) -> bytes:
        """The window's bytes (an input's), if at most ``max_bytes`` (the request's limit:
        checked before anything is allocated)."""
        if self.byte_size > max_bytes:
            raise SharedMemoryError(
                f"shared_memory_byte_size {self.byte_size} of an input is over the "
                f"{max_bytes} bytes a request may carry"
            )
        return self._held().read(self.offset, self.byte_size)

    def write(self, pieces: Sequence[Buffer], nbytes: int) -> None:
        """An answer of ``nbytes`` (its ``pieces`` joined) at the start of the window."""
        region = self._held()
        if nbytes > self.byte_size:
            raise SharedMemoryError(
                f"the output is {nbytes} bytes, over the shared_memory_byte_size "
                f"{self.byte_size} given for it in region {region.name!r}"
            )
        region.write(self.offset, pieces, nbytes)

    def release(self) -> None:
        """The request is done with the window (idempotent; on the event loop)."""
        region, self.region = self.region, None
        if region is not None:
            region.let_go()

    def _held(self) -> Region:
        region = self.region
        if region is None:  # its call ended (the caller left) before the copy
            raise Cancelled("the call ended before its shared-memory window was used")
        return region


def _pwrite_batches(
    fd: int, pieces: Iterable[Buffer], position: int, check: Callable[[], None]
) -> int:
    """Write ``pieces`` at ``position``, straight from them (one copy, by the kernel), IOV_MAX
    buffers a call, ``check`` (the object still holds the window) before each; how many
    bytes the calls wrote. An answer's pieces may be a row each: each is touched only by the
    call that copies it (its object is likely out of the cache: a second touch, to size it,
    would cost a second miss)."""
    start = position
    rest = iter(pieces)
    while batch := list(itertools.islice(rest, _IOV_MAX)):
        check()
        position += os.pwritev(fd, batch, position)
    return position - start


class _Runs:
    """The runs of rows a write has yet to start, handed out one at a time to the threads
    that write them; none more once ``stop`` is called (a thread's write failed)."""

    def __init__(self, rows: int, per_run: int) -> None:
        self._starts = iter(range(0, rows, per_run))
        self._lock = threading.Lock()

    def take(self) -> int | None:
        """The first row of the next run, or None when there is none left."""
        with self._lock:
            return next(self._starts, None)

    def stop(self) -> None:
        with self._lock:
            self._starts = iter(())


def _pwrite_rows(fd: int, rows: GatherableRows, position: int, check: Callable[[], None]) -> None:
    """Write ``rows`` at ``position`` in runs of about RUN_BYTES, each gathered and then
    written (``check`` before each write call) by whichever of this thread and the helper
    takes it; returns once every run is written, or raises this thread's failure, else the
    helper's (after the helper has stopped: no write outlives the call, whose descriptor
    may then close)."""
    per_run = max(1, RUN_BYTES // rows.row_bytes)
    runs = _Runs(len(rows), per_run)

    def write_runs() -> None:
        try:
            buffer = _run_buffer(per_run * rows.row_bytes)
            while (start := runs.take()) is not None:
                run = rows.gather(start, buffer)
                _pwrite_whole(fd, run, position + start * rows.row_bytes, check)
        except BaseException:
            runs.stop()
            raise

    helper = _HELPER.submit(write_runs) if len(rows) > per_run else None
    try:
        write_runs()
    finally:
        # A helper that has not started has nothing left to do; one that has is waited
        # for, and its failure raised unless this thread's own is on its way.
        if helper is not None and not helper.cancel():
            wait([helper])
    if helper is not None and not helper.cancelled():
        helper.result()


def _run_buffer(size: int) -> memoryview:
    """This thread's buffer for runs, of ``size`` bytes: kept across writes, because
    memory allocated and freed per run can be given back to the system and faulted in
    again each time (as under the images' malloc settings: a fixed mmap threshold leaves
    the trim threshold at 128 KiB; docs/benchmarks/README.md, "Shared memory")."""
    buffer: memoryview | None = getattr(_RUN_BUFFERS, "buffer", None)
    if buffer is None or buffer.nbytes < size:
        buffer = _RUN_BUFFERS.buffer = memoryview(bytearray(size))
    return buffer[:size]


def _pwrite_whole(fd: int, run: Buffer, position: int, check: Callable[[], None]) -> None:
    """Write all of ``run`` at ``position``, ``check`` before each write call, on from
    where a short one stopped."""
    view = memoryview(run)
    while view.nbytes:
        check()
        written = os.pwrite(fd, view, position)
        if written <= 0:
            raise OSError(0, "the write made no progress")
        position += written
        view = view[written:]


def _pwrite_all(
    fd: int, pieces: Iterable[Buffer], position: int, check: Callable[[], None]
) -> None:
    """Write every byte of ``pieces`` at ``position`` as ``_pwrite_batches`` does, and on
    from where a short write stopped."""
    rest = iter(pieces)
    while batch := list(itertools.islice(rest, _IOV_MAX)):
        left = sum(map(len, batch))  # bytes (``types.Buffer``)
        while left:
            check()
            written = os.pwritev(fd, batch, position)
            if written <= 0:
                raise OSError(0, "the write made no progress")
            position += written
            left -= written
            if left:
                batch = _unwritten(batch, written)


def _unwritten(batch: list[Buffer], written: int) -> list[Buffer]:
    """What is left of ``batch`` once its first ``written`` bytes (fewer than all) are."""
    done = 0
    while written >= len(batch[done]):
        written -= len(batch[done])
        done += 1
    return [memoryview(batch[done])[written:], *batch[done + 1 :]]
