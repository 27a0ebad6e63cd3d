"""An answer's copy into a shared-memory region: straight from its pieces, however many
(more than one vectored write takes), or, for a table's rows, gathered in runs (a write
call each) by two threads; on from where a short write stopped, and the object checked
before every write call of it. The region's other defences are tried in
test_shm_registry.py; the answers' bytes end to end in tests/e2e."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokembed.server.backends.base import LookUp
from tokembed.server.backends.table import TableBackend
from tokembed.server.core.dtypes import FLOAT32
from tokembed.server.core.types import GatherableRows, TokenIds
from tokembed.server.edge.v2 import shm_region
from tokembed.server.edge.v2.shm import SHM_ROOT, SharedMemoryRegistry
from tokembed.server.edge.v2.shm_region import SharedMemoryError

pytestmark = pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm on this system")

SIZE = 1 << 16
ME = "owner-1"  # the caller, as the front end names it (edge/auth.py's Identities)
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
IOV_MAX = IOV_MAX if IOV_MAX > 0 else 1024
REAL_PWRITEV = os.pwritev


@pytest.fixture
def region() -> Iterator[tuple[SharedMemoryRegistry, Path]]:
    """A registry with one region ``r``: an object of SIZE bytes of 0xff, the window all
    of it but its first 64 bytes."""
    prefix = f"tokembedtest{secrets.token_hex(4)}_"
    path = SHM_ROOT / f"{prefix}a"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.pwrite(fd, b"\xff" * SIZE, 0)
    finally:
        os.close(fd)
    registry = SharedMemoryRegistry(enabled=True, prefix=prefix, max_regions=4)
    registry.register("r", f"/{path.name}", 64, SIZE - 64, owner=ME)
    try:
        yield registry, path
    finally:
        asyncio.run(registry.close())
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def pieces_of(count: int) -> list[Any]:
    """``count`` pieces of 0 to 9 bytes, bytes and byte views of an array, some empty."""
    rng = np.random.default_rng(count)
    data = rng.integers(0, 255, size=count * 9, dtype=np.uint8)
    view = memoryview(data).cast("B")
    pieces: list[Any] = []
    offset = 0
    for index, size in enumerate(rng.integers(0, 10, size=count).tolist()):
        piece = view[offset : offset + size]
        pieces.append(bytes(piece) if index % 3 else piece)
        offset += size
    return pieces


def write(registry: SharedMemoryRegistry, pieces: Sequence[Any], nbytes: int | None = None) -> None:
    window = registry.use("r", 0, SIZE - 64, owner=ME)
    try:
        window.write(pieces, sum(map(len, pieces)) if nbytes is None else nbytes)
    finally:
        window.release()


def written(path: Path, size: int) -> bytes:
    data = path.read_bytes()
    assert data[:64] == b"\xff" * 64, "a byte before the window was written"
    assert data[64 + size :] == b"\xff" * (SIZE - 64 - size), "a byte after the answer"
    return data[64 : 64 + size]


def record_calls(
    monkeypatch: pytest.MonkeyPatch, change: Callable[[int, list[Any], int], int] | None = None
) -> list[int]:
    """The buffers of every ``os.pwritev`` call, counted (``change``: the call itself)."""
    calls: list[int] = []

    def pwritev(fd: int, buffers: Sequence[Any], position: int) -> int:
        calls.append(len(buffers))
        buffers = list(buffers)
        return change(fd, buffers, position) if change else REAL_PWRITEV(fd, buffers, position)

    monkeypatch.setattr(os, "pwritev", pwritev)
    return calls


def test_more_pieces_than_one_vectored_write_takes_land_whole_and_in_order(
    region: tuple[SharedMemoryRegistry, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    registry, path = region
    pieces = pieces_of(IOV_MAX * 3 + 17)
    calls = record_calls(monkeypatch)
    write(registry, pieces)
    want = b"".join(pieces)
    assert written(path, len(want)) == want
    assert calls == [IOV_MAX] * 3 + [17]  # once each, none written twice


def test_a_short_write_goes_on_from_the_byte_where_it_stopped(
    region: tuple[SharedMemoryRegistry, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each call writes at most 1000 bytes, so most stop inside a piece."""
    registry, path = region

    def at_most_1000_bytes(fd: int, buffers: list[Any], position: int) -> int:
        joined = b"".join(buffers)[:1000]
        return REAL_PWRITEV(fd, [joined[:333], joined[333:]], position)

    pieces = pieces_of(IOV_MAX + 600)
    calls = record_calls(monkeypatch, at_most_1000_bytes)
    write(registry, pieces)
    want = b"".join(pieces)
    assert written(path, len(want)) == want
    assert len(calls) >= len(want) // 1000


def test_rows_of_a_table_land_whole(
    region: tuple[SharedMemoryRegistry, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row views of an array (as an answer's are, one per id) and a padding row,
    written straight from them: no buffer a write call gets is a copy."""
    registry, path = region
    table = np.arange(40 * 8, dtype=np.float32).reshape(40, 8)
    data = table.data.cast("B")
    pad = bytes(32)
    ids = np.random.default_rng(3).integers(0, 40, size=1500).tolist()
    pieces = [data[i * 32 : (i + 1) * 32] for i in ids] + [pad] * 20
    seen: list[Any] = []

    def keep(fd: int, buffers: list[Any], position: int) -> int:
        seen.extend(buffers)
        return REAL_PWRITEV(fd, buffers, position)

    record_calls(monkeypatch, keep)
    write(registry, pieces)
    want = table[ids].tobytes() + pad * 20
    assert written(path, len(want)) == want
    owners = {id(memoryview(piece).obj) for piece in seen}
    assert owners <= {id(table), id(pad)}


def test_an_object_shrunk_between_two_write_calls_is_refused_and_not_grown(
    region: tuple[SharedMemoryRegistry, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The object is checked before each call of a write, not once before the first: a
    write call past the end of a shrunk object would grow it again."""
    registry, path = region

    def then_shrink(fd: int, buffers: list[Any], position: int) -> int:
        done = REAL_PWRITEV(fd, buffers, position)
        os.truncate(path, 4096)
        return done

    calls = record_calls(monkeypatch, then_shrink)
    with pytest.raises(SharedMemoryError, match="its object is now 4096 bytes"):
        write(registry, [b"\x01" * 4] * (IOV_MAX + 10))
    assert calls == [IOV_MAX]
    assert os.stat(path).st_size == 4096


REAL_PWRITE = os.pwrite
RUN_BYTES = 1000  # what the tests below set: several runs per answer, rows of 32 bytes


def table_rows(ids: list[int]) -> tuple[np.ndarray, Any]:
    """A [40, 8] float32 table served by the table backend, and the look-up's rows of ``ids``."""
    table = np.arange(40 * 8, dtype=np.float32).reshape(40, 8)
    backend = TableBackend(
        {FLOAT32: table.copy()}, casts={}, padding_id=None, execution_provider="test"
    )
    return table, backend.look_up(LookUp(TokenIds.of(ids), FLOAT32))


def record_writes(
    monkeypatch: pytest.MonkeyPatch, change: Callable[[int, Any, int], int] | None = None
) -> list[int]:
    """The bytes given to every ``os.pwrite`` call (``change``: the call itself); runs of
    RUN_BYTES, and no vectored write."""
    monkeypatch.setattr(shm_region, "RUN_BYTES", RUN_BYTES)
    calls: list[int] = []

    def pwrite(fd: int, data: Any, position: int) -> int:
        calls.append(len(data))
        return change(fd, data, position) if change else REAL_PWRITE(fd, data, position)

    def no_pwritev(*args: Any) -> int:
        raise AssertionError("a table's rows are written in runs, not vectored")

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "pwritev", no_pwritev)
    return calls


def test_rows_of_a_table_are_gathered_in_runs_that_land_whole_and_in_place(
    region: tuple[SharedMemoryRegistry, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    registry, path = region
    ids = np.random.default_rng(5).integers(0, 40, size=1500).tolist()
    table, rows = table_rows(ids)
    calls = record_writes(monkeypatch)
    for start, stop in ((7, 1203), (0, 1500)):  # a slice of the answer, then all of it
        pieces = rows.pieces(start, stop)
        assert isinstance(pieces, GatherableRows)
        calls.clear()
        write(registry, pieces)
        want = table[ids[start:stop]].tobytes()
        assert written(path, len(want)) == want
        per_run = RUN_BYTES // 32 * 32  # whole rows: 31 a run
        # Two threads write the runs, in whichever order they take them: each once.
        assert sorted(calls) == sorted([per_run] * (len(want) // per_run) + [len(want) % per_run])


def test_runs_go_on_from_the_byte_where_a_short_write_stopped(
    region: tuple[SharedMemoryRegistry, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    registry, path = region
    ids = np.random.default_rng(6).integers(0, 40, size=900).tolist()
    table, rows = table_rows(ids)

    def at_most_333_bytes(fd: int, data: Any, position: int) -> int:
        return REAL_PWRITE(fd, memoryview(data)[:333], position)

    calls = record_writes(monkeypatch, at_most_333_bytes)
    write(registry, rows.pieces(0, 900))
    want = table[ids].tobytes()
    assert written(path, len(want)) == want
    assert len(calls) >= len(want) // 333


def test_an_object_shrunk_between_two_runs_is_refused_and_not_grown(
    region: tuple[SharedMemoryRegistry, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The object is checked before each run's write. With one thread: a second writing
    beside it may have checked the object before the shrink (as a caller may shrink it
    between any check and the write after it: the check bounds what a write may grow to
    the window the caller registered, docs/security.md)."""
    registry, path = region
    monkeypatch.setattr(shm_region, "_HELPER", NoHelper())
    _, rows = table_rows(list(range(40)) * 40)

    def then_shrink(fd: int, data: Any, position: int) -> int:
        done = REAL_PWRITE(fd, data, position)
        os.truncate(path, 4096)
        return done

    calls = record_writes(monkeypatch, then_shrink)
    with pytest.raises(SharedMemoryError, match="its object is now 4096 bytes"):
        write(registry, rows.pieces(0, 1600))
    assert len(calls) == 1
    assert os.stat(path).st_size == 4096


class NoHelper(concurrent.futures.Executor):
    """An executor that never runs what it is given (a helper always busy elsewhere)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        return concurrent.futures.Future()


def test_a_write_whose_helper_is_busy_writes_every_run_itself(
    region: tuple[SharedMemoryRegistry, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    registry, path = region
    monkeypatch.setattr(shm_region, "_HELPER", NoHelper())
    ids = np.random.default_rng(7).integers(0, 40, size=1000).tolist()
    table, rows = table_rows(ids)
    threads: set[str] = set()

    def note_thread(fd: int, data: Any, position: int) -> int:
        threads.add(threading.current_thread().name)
        return REAL_PWRITE(fd, data, position)

    record_writes(monkeypatch, note_thread)
    write(registry, rows.pieces(0, 1000))
    assert written(path, 32 * 1000) == table[ids].tobytes()
    assert threads == {threading.current_thread().name}


def test_both_threads_write_runs_of_a_large_answer(
    region: tuple[SharedMemoryRegistry, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calling thread's first write waits until the helper has written a run: the
    helper takes part, whatever the scheduling."""
    registry, path = region
    ids = np.random.default_rng(8).integers(0, 40, size=1500).tolist()
    table, rows = table_rows(ids)
    caller = threading.current_thread().name
    helper_wrote = threading.Event()
    threads: list[str] = []

    def wait_for_the_helper(fd: int, data: Any, position: int) -> int:
        name = threading.current_thread().name
        threads.append(name)
        if name == caller:
            assert helper_wrote.wait(10), "the helper wrote no run"
        done = REAL_PWRITE(fd, data, position)
        if name != caller:
            helper_wrote.set()
        return done

    record_writes(monkeypatch, wait_for_the_helper)
    write(registry, rows.pieces(0, 1500))
    assert written(path, 32 * 1500) == table[ids].tobytes()
    assert caller in threads
    assert any(name.startswith("tokembed-shm-write") for name in threads)


def test_a_failed_run_stops_the_other_thread_and_is_raised_once_both_stopped(
    region: tuple[SharedMemoryRegistry, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calling thread's write fails while the helper is in one of its own: the write
    raises only once the helper's is done (no write outlives the call, whose descriptor
    may close after it), and neither thread starts another run."""
    registry, _ = region
    _, rows = table_rows(list(range(40)) * 40)
    caller = threading.current_thread().name
    helper_writing = threading.Event()
    stopped = threading.Event()  # the runs were stopped (the caller's failure)
    helper_done = threading.Event()
    calls: list[str] = []
    stop = shm_region._Runs.stop

    def stop_and_tell(runs: Any) -> None:
        stop(runs)
        stopped.set()

    def fail_beside_a_slow_helper(fd: int, data: Any, position: int) -> int:
        name = threading.current_thread().name
        calls.append(name)
        if name == caller:
            assert helper_writing.wait(10), "the helper wrote no run"
            raise OSError(5, "Input/output error")
        helper_writing.set()
        assert stopped.wait(10), "the caller's failure did not stop the runs"
        time.sleep(0.2)  # long after the caller's failure: a write that did not wait is gone
        done = REAL_PWRITE(fd, data, position)
        helper_done.set()
        return done

    monkeypatch.setattr(shm_region._Runs, "stop", stop_and_tell)

    record_writes(monkeypatch, fail_beside_a_slow_helper)
    with pytest.raises(SharedMemoryError, match="cannot write region 'r': Input/output error"):
        write(registry, rows.pieces(0, 1600))
    assert helper_done.is_set()
    assert calls.count(caller) == 1
    assert len(calls) == 2  # the helper's one run: it took no other after the failure


def test_a_failed_run_of_the_helper_is_raised_by_the_write(
    region: tuple[SharedMemoryRegistry, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    registry, _ = region
    _, rows = table_rows(list(range(40)) * 40)
    caller = threading.current_thread().name
    helper_failed = threading.Event()

    def the_helper_fails(fd: int, data: Any, position: int) -> int:
        if threading.current_thread().name == caller:
            assert helper_failed.wait(10), "the helper wrote no run"
            return REAL_PWRITE(fd, data, position)
        helper_failed.set()
        raise OSError(28, "No space left on device")

    record_writes(monkeypatch, the_helper_fails)
    with pytest.raises(SharedMemoryError, match="No space left on device"):
        write(registry, rows.pieces(0, 1600))
