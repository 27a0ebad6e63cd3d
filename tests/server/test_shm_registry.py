"""The system shared-memory registry (server/edge/v2/shm.py) against every abuse we know of.

Real POSIX shared-memory objects in /dev/shm, made here as a client makes them (open,
ftruncate), each test under a prefix of its own. The registry is driven through its public
methods, the ones the V2 front end calls; tests/e2e/test_v2_shared_memory.py drives the same
through the real server and tritonclient.

The attacks, each with the defence it hits (test name in brackets):

 1. register while the server has shared memory off            -> refused, nothing opened
    [test_off_by_default_refuses_every_call]
 2. a key outside the prefix, or not one path component (other '/', '..', no leading
    '/', NUL, odd characters, too long)                           -> refused before any open
    [test_keys_outside_the_prefix_are_refused_unopened]
 3. a symbolic link under the prefix to a file elsewhere        -> O_NOFOLLOW: refused
    [test_a_link_under_the_prefix_is_not_followed]
 3b. a hard link under the prefix to another object (or an object with a second name)
                                                                -> refused
    [test_a_hard_link_under_the_prefix_is_refused]
 3c. an object owned by another user                            -> refused
    [test_an_object_of_another_user_is_refused]
 4. a FIFO or a directory under the prefix                      -> refused, no hang
    [test_a_fifo_or_directory_under_the_prefix_is_refused]
 5. a key that names no object (hoping the server makes one)     -> refused, nothing made
    [test_a_missing_object_is_not_created]
 6. offset + byte_size that wraps a 64-bit sum, or past the end -> refused (Python ints)
    [test_registration_sizes_are_checked_without_wrapping]
 7. triton#8330: the registration offset counted twice          -> bytes land at offset
    [test_the_registration_offset_counts_once]
 8. a request's offset/size outside the window                  -> refused
    [test_a_request_outside_its_window_is_refused]
 9. the object shrinks or is emptied after registration         -> clear error, no SIGBUS
    [test_a_shrunk_object_gives_a_clear_error]
10. the object shrinks and grows while the server writes it     -> every write succeeds or
    fails cleanly; the process lives (no mapping: no SIGBUS)
    [test_truncation_racing_writes_never_kills_the_process]
11. an input window of a terabyte                                -> refused before any
    allocation [test_a_huge_input_window_is_refused_before_reading]
12. an answer larger than the output window                     -> refused, nothing written
    [test_an_answer_larger_than_its_window_is_refused]
13. unregister while a request uses the region                  -> waits for it
    [test_unregister_waits_for_the_requests_using_it]
13b. the unregistering call cancelled or timed out while it waits -> the region is closed
    all the same once unused; shutdown reaches it; it counts against the cap until closed
    [test_an_unregistration_that_ends_early_still_closes_the_region,
    test_shutdown_closes_a_region_whose_unregistration_ended_early,
    test_a_region_being_unregistered_counts_until_closed]
14. unregister while a copy runs on a worker thread (its caller left) -> the descriptor
    outlives the copy [test_a_copy_in_progress_keeps_its_descriptor]
15. registering more regions than allowed (descriptors)         -> refused, no leak
    [test_at_most_max_regions]
16. error messages fishing for another region's name or key    -> never echoed
    [test_errors_never_name_another_region]
17. shutdown with regions registered                            -> all let go
    [test_close_unregisters_everything]
18. a second registration under a taken name                    -> refused, first intact
    [test_a_taken_name_is_refused]
19. an answer framed after its call ended (the caller left)     -> nothing written
    [test_a_window_whose_call_ended_writes_nothing]
20. another owner's region listed, used, unregistered or replaced -> its owner's alone,
    refused as a name never registered [test_a_region_is_its_owner_s_alone,
    test_a_region_input_is_read_from_its_caller_s_region_alone]; the cap
    counts every owner's [test_the_region_cap_counts_every_owner]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tokembed.server.core.errors import Cancelled, Internal
from tokembed.server.edge.v2.requests import InferCall, InferParser
from tokembed.server.edge.v2.shm import (
    SHM_ROOT,
    RegionExists,
    RegionNotFound,
    SharedMemoryOff,
    SharedMemoryRegistry,
)
from tokembed.server.edge.v2.shm_region import SharedMemoryError
from tokembed.server.edge.v2.shm_service import SharedMemoryInputs
from tokembed.v2 import grpc_service_pb2 as pb

pytestmark = pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm on this system")

SIZE = 1 << 16
ME = "owner-1"  # the caller, as the front end names it (edge/auth.py's Identities)


class Objects:
    """POSIX shared-memory objects made as a client makes them, removed at the end."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.made: list[Path] = []

    def make(self, suffix: str, size: int = SIZE, data: bytes | None = None) -> str:
        """A new object ``/<prefix><suffix>`` of ``size`` bytes; its key."""
        path = SHM_ROOT / f"{self.prefix}{suffix}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self.made.append(path)
        try:
            os.ftruncate(fd, size)
            if data is not None:
                os.pwrite(fd, data, 0)
        finally:
            os.close(fd)
        return f"/{path.name}"

    def path(self, key: str) -> Path:
        return SHM_ROOT / key.lstrip("/")

    def read(self, key: str, offset: int, size: int) -> bytes:
        with open(self.path(key), "rb") as file:
            file.seek(offset)
            return file.read(size)

    def truncate(self, key: str, size: int) -> None:
        os.truncate(self.path(key), size)

    def remove(self) -> None:
        for path in self.made:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


@pytest.fixture
def objects() -> Iterator[Objects]:
    made = Objects(f"tokembedtest{secrets.token_hex(4)}_")
    try:
        yield made
    finally:
        made.remove()


def registry(
    objects: Objects, *, enabled: bool = True, max_regions: int = 8
) -> SharedMemoryRegistry:
    return SharedMemoryRegistry(enabled=enabled, prefix=objects.prefix, max_regions=max_regions)


def open_descriptors(path: Path) -> int:
    """How many of this process's descriptors are open on ``path``'s object."""
    count = 0
    for entry in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(entry).removesuffix(" (deleted)") == str(path):
                count += 1
    return count


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


# --- 1. off


def test_off_by_default_refuses_every_call(objects: Objects) -> None:
    key = objects.make("a")
    off = registry(objects, enabled=False)
    with pytest.raises(SharedMemoryOff, match="--shared-memory system"):
        off.register("a", key, 0, SIZE, owner=ME)
    with pytest.raises(SharedMemoryOff):
        off.status(owner=ME)
    with pytest.raises(SharedMemoryOff):
        off.use("a", 0, 8, owner=ME)
    with pytest.raises(SharedMemoryOff):
        run(off.unregister("a", owner=ME))
    assert open_descriptors(objects.path(key)) == 0


# --- 2-5. keys


@pytest.mark.parametrize(
    "key",
    [
        "{prefix}a",  # no leading '/'
        "/other_a",  # outside the prefix
        "/x{prefix}a",  # the prefix not at the start
        "/{prefix}a/../../etc/passwd",  # other '/'
        "/{prefix}..a",  # '..'
        "//{prefix}a",  # an empty first component
        "/{prefix}a\x00b",  # NUL
        "/{prefix}a b",  # a character outside the set
        "/{prefix}é",  # not ASCII
        "/{prefix}" + "a" * 300,  # longer than NAME_MAX
        "/",
        "",
    ],
)
def test_keys_outside_the_prefix_are_refused_unopened(objects: Objects, key: str) -> None:
    objects.make("a")
    other = SHM_ROOT / "other_a"
    key = key.replace("{prefix}", objects.prefix)
    with pytest.raises(SharedMemoryError, match="must be '/' and then a name starting with"):
        registry(objects).register("r", key, 0, 8, owner=ME)
    assert not other.exists()
    assert open_descriptors(objects.path(f"/{objects.prefix}a")) == 0


def test_a_link_under_the_prefix_is_not_followed(objects: Objects, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * SIZE)
    link = SHM_ROOT / f"{objects.prefix}link"
    link.symlink_to(secret)
    objects.made.append(link)
    with pytest.raises(SharedMemoryError, match="cannot open shared-memory object"):
        registry(objects).register("r", f"/{link.name}", 0, 8, owner=ME)
    assert open_descriptors(secret) == 0
    assert secret.read_bytes() == b"s" * SIZE


def test_a_hard_link_under_the_prefix_is_refused(objects: Objects) -> None:
    """A hard link is not stopped by O_NOFOLLOW: an object with more than one name is
    refused, whichever of its names is given (the link, or the object it links to)."""
    target = objects.make("target", data=b"t" * SIZE)
    link = SHM_ROOT / f"{objects.prefix}hardlink"
    os.link(objects.path(target), link)
    objects.made.append(link)
    shm = registry(objects)
    for key in (f"/{link.name}", target):
        with pytest.raises(SharedMemoryError, match=f"{key!r} has 2 names"):
            shm.register("r", key, 0, 8, owner=ME)
    assert shm.status(owner=ME) == []
    assert open_descriptors(objects.path(target)) == 0
    assert objects.read(target, 0, SIZE) == b"t" * SIZE
    # With the link gone, the object has one name again and registers.
    link.unlink()
    shm.register("r", target, 0, 8, owner=ME)
    run(shm.unregister("r", owner=ME))


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_an_object_of_another_user_is_refused(objects: Objects) -> None:
    """Run as root, the test gives an object to another uid (a client's object the server
    could open only through its rights): refused."""
    key = objects.make("theirs", data=b"o" * SIZE)
    os.chown(objects.path(key), 4242, -1)
    shm = registry(objects)
    with pytest.raises(SharedMemoryError, match=f"{key!r} belongs to uid 4242, not to"):
        shm.register("r", key, 0, 8, owner=ME)
    assert shm.status(owner=ME) == []
    assert open_descriptors(objects.path(key)) == 0
    os.chown(objects.path(key), os.geteuid(), -1)
    shm.register("r", key, 0, 8, owner=ME)
    run(shm.unregister("r", owner=ME))


def test_a_fifo_or_directory_under_the_prefix_is_refused(objects: Objects) -> None:
    fifo = SHM_ROOT / f"{objects.prefix}fifo"
    os.mkfifo(fifo)
    objects.made.append(fifo)
    directory = SHM_ROOT / f"{objects.prefix}dir"
    directory.mkdir()
    try:
        shm = registry(objects)
        # A FIFO opened without O_NONBLOCK would wait for a writer forever: this returns.
        with pytest.raises(SharedMemoryError, match="is not a shared-memory object"):
            shm.register("f", f"/{fifo.name}", 0, 8, owner=ME)
        with pytest.raises(SharedMemoryError, match="cannot open shared-memory object"):
            shm.register("d", f"/{directory.name}", 0, 8, owner=ME)
        assert shm.status(owner=ME) == []
    finally:
        directory.rmdir()


def test_a_missing_object_is_not_created(objects: Objects) -> None:
    with pytest.raises(SharedMemoryError, match="No such file"):
        registry(objects).register("r", f"/{objects.prefix}missing", 0, 8, owner=ME)
    assert not (SHM_ROOT / f"{objects.prefix}missing").exists()


# --- 6-8. sizes and offsets


@pytest.mark.parametrize(
    ("offset", "byte_size"),
    [
        (2**64 - 1, 2),  # wraps to 1 in 64 bits
        (2**63, 2**63),  # wraps to 0
        (1, 2**64 - 1),
        (SIZE, 1),  # one past the end
        (0, SIZE + 1),
        (SIZE - 8, 9),
        (-1, 8),
        (0, 0),
        (0, -SIZE),
    ],
)
def test_registration_sizes_are_checked_without_wrapping(
    objects: Objects, offset: int, byte_size: int
) -> None:
    key = objects.make("a")
    shm = registry(objects)
    with pytest.raises(SharedMemoryError):
        shm.register("r", key, offset, byte_size, owner=ME)
    assert shm.status(owner=ME) == []
    assert open_descriptors(objects.path(key)) == 0


def test_the_registration_offset_counts_once(objects: Objects) -> None:
    key = objects.make("a")
    shm = registry(objects)
    offset = 4096
    # The window fits only if its offset is counted once.
    shm.register("r", key, offset, SIZE - offset, owner=ME)
    window = shm.use("r", 0, SIZE - offset, owner=ME)
    window.write([b"\x01" * (SIZE - offset)], SIZE - offset)
    window.release()
    assert objects.read(key, 0, offset) == bytes(offset)
    assert objects.read(key, offset, SIZE) == b"\x01" * (SIZE - offset)
    # A request's offset is within the window, added to the registration's once.
    window = shm.use("r", 100, 8, owner=ME)
    window.write([b"abcdefgh"], 8)
    window.release()
    assert objects.read(key, offset + 100, 8) == b"abcdefgh"
    window = shm.use("r", 100, 8, owner=ME)
    assert window.read(8) == b"abcdefgh"
    window.release()


@pytest.mark.parametrize(
    ("offset", "byte_size"),
    [(0, 1025), (1024, 1), (1000, 100), (-1, 8), (0, 0), (0, -1), (2**64 - 1, 2), (2**63, 2**63)],
)
def test_a_request_outside_its_window_is_refused(
    objects: Objects, offset: int, byte_size: int
) -> None:
    key = objects.make("a")
    shm = registry(objects)
    shm.register("r", key, 512, 1024, owner=ME)
    with pytest.raises(SharedMemoryError, match="is outside region 'r'"):
        shm.use("r", offset, byte_size, owner=ME)
    with pytest.raises(RegionNotFound):
        shm.use("nope", 0, 8, owner=ME)
    # Nothing held: unregistering returns at once.
    run(asyncio.wait_for(shm.unregister("r", owner=ME), 10))


# --- 9-12. the object changes under the server


@pytest.mark.parametrize("new_size", [0, SIZE // 2, SIZE - 1])
def test_a_shrunk_object_gives_a_clear_error(objects: Objects, new_size: int) -> None:
    key = objects.make("a")
    shm = registry(objects)
    shm.register("r", key, 0, SIZE, owner=ME)
    objects.truncate(key, new_size)
    window = shm.use("r", 0, SIZE, owner=ME)
    with pytest.raises(SharedMemoryError, match=f"its object is now {new_size} bytes"):
        window.write([b"x" * SIZE], SIZE)
    with pytest.raises(SharedMemoryError, match="register it again"):
        window.read(SIZE)
    window.release()
    # Grown back, the registration serves again: it is the same object.
    objects.truncate(key, SIZE)
    window = shm.use("r", 0, 4, owner=ME)
    window.write([b"back"], 4)
    window.release()
    assert objects.read(key, 0, 4) == b"back"


def test_an_unlinked_object_stays_the_registered_one(objects: Objects) -> None:
    """A client may unlink its object once registered (so that a crash leaks nothing):
    the registration keeps the object, as the client's own mapping does."""
    key = objects.make("a")
    shm = registry(objects)
    shm.register("r", key, 0, SIZE, owner=ME)
    fd = os.open(objects.path(key), os.O_RDWR)  # the client's hold on it
    try:
        objects.path(key).unlink()
        window = shm.use("r", 8, 4, owner=ME)
        window.write([b"seen"], 4)
        window.release()
        assert os.pread(fd, 4, 8) == b"seen"
    finally:
        os.close(fd)
    run(shm.unregister("r", owner=ME))


def test_truncation_racing_writes_never_kills_the_process(objects: Objects) -> None:
    size = 8 << 20
    key = objects.make("a", size)
    shm = registry(objects)
    shm.register("r", key, 0, size, owner=ME)
    answer = b"\x5a" * size
    stop = threading.Event()
    truncations = [0]

    def shrink_and_grow() -> None:
        while not stop.is_set():
            objects.truncate(key, 4096)
            objects.truncate(key, size)
            truncations[0] += 1

    racer = threading.Thread(target=shrink_and_grow)
    racer.start()
    outcomes = {"written": 0, "refused": 0}
    try:
        for _ in range(300):
            window = shm.use("r", 0, size, owner=ME)
            try:
                window.write([answer[: size // 2], answer[size // 2 :]], size)
                outcomes["written"] += 1
            except SharedMemoryError as error:
                assert "register it again" in str(error)
                outcomes["refused"] += 1
            finally:
                window.release()
    finally:
        stop.set()
        racer.join()
    # Alive: a mapping truncated under a copy would have raised SIGBUS and ended the
    # test run here. Both outcomes happened, so the race was real.
    assert truncations[0] > 0
    assert outcomes["written"] + outcomes["refused"] == 300
    run(shm.unregister("r", owner=ME))


def test_a_huge_input_window_is_refused_before_reading(objects: Objects) -> None:
    huge = 1 << 40  # sparse: tmpfs allocates pages only when written
    key = objects.make("a", huge)
    shm = registry(objects)
    shm.register("r", key, 0, huge, owner=ME)
    window = shm.use("r", 0, huge, owner=ME)
    with pytest.raises(SharedMemoryError, match="over the 1048576 bytes a request may carry"):
        window.read(1 << 20)
    window.release()


def test_an_answer_larger_than_its_window_is_refused(objects: Objects) -> None:
    key = objects.make("a", data=b"\xee" * SIZE)
    shm = registry(objects)
    shm.register("r", key, 0, SIZE, owner=ME)
    window = shm.use("r", 0, 16, owner=ME)
    with pytest.raises(SharedMemoryError, match="the output is 17 bytes, over"):
        window.write([b"y" * 17], 17)
    window.release()
    assert objects.read(key, 0, SIZE) == b"\xee" * SIZE


# --- 13-18. lifetime, counts, messages


def test_unregister_waits_for_the_requests_using_it(objects: Objects) -> None:
    key = objects.make("a")

    async def scenario() -> None:
        shm = registry(objects)
        shm.register("r", key, 0, SIZE, owner=ME)
        window = shm.use("r", 0, 8, owner=ME)
        unregistering = asyncio.ensure_future(shm.unregister("r", owner=ME))
        for _ in range(20):  # every step the loop can take without the window's release
            await asyncio.sleep(0)
        assert not unregistering.done()
        # Gone for new requests already; the one in flight still works.
        with pytest.raises(RegionNotFound):
            shm.use("r", 0, 8, owner=ME)
        window.write([b"inflight"], 8)
        assert open_descriptors(objects.path(key)) == 1
        window.release()
        await asyncio.wait_for(unregistering, 10)
        assert open_descriptors(objects.path(key)) == 0

    run(scenario())
    assert objects.read(key, 0, 8) == b"inflight"


@pytest.mark.parametrize("ending", ["cancelled", "timed out"])
def test_an_unregistration_that_ends_early_still_closes_the_region(
    objects: Objects, ending: str
) -> None:
    """The unregistering call is cancelled (its caller left) or times out while a request
    holds the region: the region is still closed once that request lets it go."""
    key = objects.make("a")

    async def scenario() -> None:
        shm = registry(objects)
        shm.register("r", key, 0, SIZE, owner=ME)
        window = shm.use("r", 0, 8, owner=ME)
        unregistering = asyncio.ensure_future(
            shm.unregister("r", owner=ME) if ending == "cancelled" else asyncio.wait_for(
                shm.unregister("r", owner=ME), 0.05
            )
        )  # fmt: skip
        for _ in range(20):
            await asyncio.sleep(0)
        if ending == "cancelled":
            unregistering.cancel()
        with pytest.raises((asyncio.CancelledError, TimeoutError)):
            await asyncio.wait_for(unregistering, 30)
        assert shm.status(owner=ME) == []
        assert open_descriptors(objects.path(key)) == 1  # the request still uses it
        window.write([b"inflight"], 8)
        window.release()
        assert open_descriptors(objects.path(key)) == 0

    run(scenario())
    assert objects.read(key, 0, 8) == b"inflight"


def test_shutdown_closes_a_region_whose_unregistration_ended_early(objects: Objects) -> None:
    key = objects.make("a")

    async def scenario() -> None:
        shm = registry(objects)
        shm.register("r", key, 0, SIZE, owner=ME)
        window = shm.use("r", 0, 8, owner=ME)
        unregistering = asyncio.ensure_future(shm.unregister("r", owner=ME))
        await asyncio.sleep(0)
        unregistering.cancel()
        with pytest.raises(asyncio.CancelledError):
            await unregistering
        await shm.close()
        assert open_descriptors(objects.path(key)) == 0
        window.release()  # the request ends after the server closed it: nothing to do

    run(scenario())


def test_a_region_being_unregistered_counts_until_closed(objects: Objects) -> None:
    """It holds its descriptor until the request using it ends: it counts against
    --shared-memory-max-regions until then, whatever became of its unregistration."""
    key = objects.make("a")

    async def scenario() -> None:
        shm = registry(objects, max_regions=1)
        shm.register("r0", key, 0, SIZE, owner=ME)
        window = shm.use("r0", 0, 8, owner=ME)
        unregistering = asyncio.ensure_future(shm.unregister("r0", owner=ME))
        await asyncio.sleep(0)
        unregistering.cancel()
        with pytest.raises(asyncio.CancelledError):
            await unregistering
        with pytest.raises(SharedMemoryError, match="1 regions are registered, the most"):
            shm.register("r1", key, 0, SIZE, owner=ME)
        assert open_descriptors(objects.path(key)) == 1
        window.release()
        shm.register("r1", key, 0, SIZE, owner=ME)
        assert open_descriptors(objects.path(key)) == 1
        await shm.unregister(owner=ME)
        assert open_descriptors(objects.path(key)) == 0

    run(scenario())


class _HeldPieces(list[bytes]):
    """An answer whose pieces are handed over only when the test says so: a write that is
    in progress, deterministically, on another thread."""

    def __init__(self, data: bytes) -> None:
        super().__init__([data])
        self.reading = threading.Event()
        self.go_on = threading.Event()

    def __iter__(self) -> Iterator[bytes]:
        self.reading.set()
        assert self.go_on.wait(30)
        return super().__iter__()


def test_a_copy_in_progress_keeps_its_descriptor(objects: Objects) -> None:
    key = objects.make("a")
    pieces = _HeldPieces(b"late")

    async def scenario() -> None:
        shm = registry(objects)
        shm.register("r", key, 0, SIZE, owner=ME)
        window = shm.use("r", 0, 4, owner=ME)
        loop = asyncio.get_running_loop()
        writing = loop.run_in_executor(None, window.write, pieces, 4)
        assert await loop.run_in_executor(None, pieces.reading.wait, 30)
        # The caller left: its window is released while the copy still runs.
        window.release()
        await asyncio.wait_for(shm.unregister("r", owner=ME), 10)
        assert open_descriptors(objects.path(key)) == 1  # not closed under the copy
        pieces.go_on.set()
        await asyncio.wait_for(writing, 30)
        assert open_descriptors(objects.path(key)) == 0

    run(scenario())
    assert objects.read(key, 0, 4) == b"late"


def test_a_window_whose_call_ended_writes_nothing(objects: Objects) -> None:
    """The call ended (its caller left) while its answer was being computed: the frame
    that comes after writes nothing, and says so as the domain's Cancelled."""
    key = objects.make("a", data=b"\xee" * SIZE)
    shm = registry(objects)
    shm.register("r", key, 0, SIZE, owner=ME)
    window = shm.use("r", 0, 8, owner=ME)
    window.release()
    window.release()  # idempotent: gRPC's done callback and a caller may both release
    with pytest.raises(Cancelled, match="the call ended"):
        window.write([b"too late"], 8)
    with pytest.raises(Cancelled):
        window.read(8)
    assert objects.read(key, 0, SIZE) == b"\xee" * SIZE
    run(asyncio.wait_for(shm.unregister("r", owner=ME), 10))  # nothing held


def test_at_most_max_regions(objects: Objects) -> None:
    key = objects.make("a")
    shm = registry(objects, max_regions=3)
    for index in range(3):
        shm.register(f"r{index}", key, 0, SIZE, owner=ME)
    with pytest.raises(SharedMemoryError, match="3 regions are registered, the most"):
        shm.register("r3", key, 0, SIZE, owner=ME)
    assert open_descriptors(objects.path(key)) == 3
    run(shm.unregister("r0", owner=ME))
    shm.register("r3", key, 0, SIZE, owner=ME)
    run(shm.unregister(owner=ME))
    assert open_descriptors(objects.path(key)) == 0


def test_errors_never_name_another_region(objects: Objects) -> None:
    secret_key = objects.make("secret_c0ffee")
    own = objects.make("own")
    shm = registry(objects)
    shm.register("secret-region-7f3a", secret_key, 16, 64, owner=ME)
    messages: list[str] = []
    attempts = [
        lambda: shm.register("secret-region-7f3a", own, 0, 8, owner=ME),  # the name is taken
        lambda: shm.register("mine", "/elsewhere", 0, 8, owner=ME),
        lambda: shm.register("mine", f"/{objects.prefix}nothing", 0, 8, owner=ME),
        lambda: shm.register("mine", own, 0, SIZE + 1, owner=ME),
        lambda: shm.register("mine", own, 2**64 - 1, 2, owner=ME),
        lambda: shm.status("mine", owner=ME),
        lambda: shm.use("mine", 0, 8, owner=ME),
        lambda: shm.use("secret-region-7f3b", 0, 8, owner=ME),
    ]
    for attempt in attempts:
        with pytest.raises(SharedMemoryError) as caught:
            attempt()
        messages.append(str(caught.value))
    shm.register("mine", own, 0, 32, owner=ME)
    for call in (
        lambda: shm.use("mine", 16, 17, owner=ME),
        lambda: shm.use("mine", 0, 64, owner=ME),
    ):
        with pytest.raises(SharedMemoryError) as caught:
            call()
        messages.append(str(caught.value))
    assert len(messages) == 10
    # The one message about the taken name echoes what its caller sent, and nothing else.
    assert messages[0] == "a region named 'secret-region-7f3a' is registered already"
    for message in messages[1:]:  # each names what its own request named, if anything
        assert "secret-region-7f3a" not in message, message
        assert "c0ffee" not in message, message


def test_a_taken_name_is_refused(objects: Objects) -> None:
    first = objects.make("first")
    second = objects.make("second")
    shm = registry(objects)
    shm.register("r", first, 0, SIZE, owner=ME)
    with pytest.raises(RegionExists):
        shm.register("r", second, 0, 8, owner=ME)
    (status,) = shm.status("r", owner=ME)
    assert (status.key, status.offset, status.byte_size) == (first, 0, SIZE)
    assert open_descriptors(objects.path(second)) == 0


def test_close_unregisters_everything(objects: Objects) -> None:
    key = objects.make("a")
    shm = registry(objects)
    shm.register("r1", key, 0, SIZE, owner=ME)
    shm.register("r2", key, 8, 8, owner=ME)
    assert [s.name for s in shm.status(owner=ME)] == ["r1", "r2"]
    run(shm.close())
    assert open_descriptors(objects.path(key)) == 0
    with pytest.raises(SharedMemoryOff, match="stopping"):
        shm.register("r3", key, 0, 8, owner=ME)


def test_a_region_is_its_owner_s_alone(objects: Objects) -> None:
    """Another owner neither lists, uses, unregisters nor replaces it; each refusal is the
    one for a name never registered."""
    mine = objects.make("mine", data=b"m" * SIZE)
    theirs = objects.make("theirs")
    other = "owner-2"
    shm = registry(objects)
    shm.register("r", mine, 0, SIZE, owner=ME)

    def message(call: object, *args: object, **kwargs: object) -> str:
        with pytest.raises(SharedMemoryError) as caught:
            call(*args, **kwargs)  # type: ignore[operator]
        return str(caught.value).replace("never", "r")

    assert shm.status(owner=other) == []
    assert message(shm.status, "r", owner=other) == message(shm.status, "never", owner=other)
    assert message(shm.use, "r", 0, 8, owner=other) == message(shm.use, "never", 0, 8, owner=other)
    run(shm.unregister("r", owner=other))
    run(shm.unregister(owner=other))
    assert [s.key for s in shm.status(owner=ME)] == [mine]
    # The same name registered by the other owner is its own, beside the first.
    shm.register("r", theirs, 0, 8, owner=other)
    assert [s.key for s in shm.status("r", owner=other)] == [theirs]
    assert [s.key for s in shm.status("r", owner=ME)] == [mine]
    window = shm.use("r", 0, 8, owner=ME)
    assert window.read(8) == b"m" * 8
    window.release()
    # Unregistering every region is every region of the caller's.
    run(shm.unregister(owner=ME))
    assert shm.status(owner=ME) == []
    assert [s.key for s in shm.status(owner=other)] == [theirs]
    assert open_descriptors(objects.path(mine)) == 0
    assert open_descriptors(objects.path(theirs)) == 1


def test_a_region_input_is_read_from_its_caller_s_region_alone(objects: Objects) -> None:
    """The V2 parser describes a region input without its caller (gRPC's deserializer
    does not know it); the servicer names the caller before the data plane reads it.
    Read for another identity, it is refused as a name never registered; read for none,
    it is a bug, never a read of whoever's region has the name."""
    ids = np.arange(8, dtype="<i8").tobytes()
    mine = objects.make("in", data=ids)
    shm = registry(objects)
    shm.register("in", mine, 0, SIZE, owner=ME)
    parse = InferParser(1 << 20, 4096, source=SharedMemoryInputs(shm, 1 << 20))

    def parsed(region: str) -> InferCall:
        request = pb.ModelInferRequest(model_name="m")
        tensor = request.inputs.add(name="input_ids", datatype="INT64", shape=[1, 8])
        tensor.parameters["shared_memory_region"].string_param = region
        tensor.parameters["shared_memory_byte_size"].int64_param = len(ids)
        call = parse(request.SerializeToString())
        assert isinstance(call, InferCall)
        return call

    call = parsed("in")
    [region] = call.callers_inputs
    assert call.body.data is region
    with pytest.raises(Internal, match="before its caller was named"):
        run(region.read())
    call.sent_by("owner-2")
    with pytest.raises(SharedMemoryError) as theirs:
        run(region.read())
    never = parsed("never")
    never.sent_by("owner-2")
    with pytest.raises(SharedMemoryError) as missing:
        run(never.callers_inputs[0].read())
    assert str(theirs.value) == str(missing.value).replace("never", "in")
    call.sent_by(ME)
    assert run(region.read()) == ids


def test_the_region_cap_counts_every_owner(objects: Objects) -> None:
    key = objects.make("a")
    shm = registry(objects, max_regions=2)
    shm.register("r", key, 0, SIZE, owner=ME)
    shm.register("r", key, 0, SIZE, owner="owner-2")
    with pytest.raises(SharedMemoryError, match="2 regions are registered, the most"):
        shm.register("s", key, 0, SIZE, owner="owner-3")
    run(shm.close())
    assert open_descriptors(objects.path(key)) == 0


def test_status_is_triton_s(objects: Objects) -> None:
    key = objects.make("a")
    shm = registry(objects)
    assert shm.status(owner=ME) == []
    shm.register("in", key, 0, 1024, owner=ME)
    shm.register("out", key, 1024, 4096, owner=ME)
    assert [(s.name, s.key, s.offset, s.byte_size) for s in shm.status(owner=ME)] == [
        ("in", key, 0, 1024),
        ("out", key, 1024, 4096),
    ]
    assert [s.name for s in shm.status("out", owner=ME)] == ["out"]
    with pytest.raises(RegionNotFound):
        shm.status("gone", owner=ME)
    run(shm.unregister("in", owner=ME))
    run(shm.unregister("in", owner=ME))  # idempotent, as Triton's
    assert [s.name for s in shm.status(owner=ME)] == ["out"]
