"""In-place bytes: a real ``bytes`` object, filled through a numpy view, kept alive by it."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest

from tokembed.server import inplace_bytes
from tokembed.server.memory import release_free_memory

pytestmark = pytest.mark.skipif(
    not inplace_bytes.available(), reason="this interpreter's bytes layout is not CPython's"
)


def test_bytes_filled_through_the_view_read_back_exactly() -> None:
    data, view = inplace_bytes.allocate(1 << 20)
    pattern = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    view[:] = pattern
    assert type(data) is bytes and len(data) == 1 << 20
    assert data == pattern.tobytes()
    assert hash(data) == hash(pattern.tobytes())  # an ordinary bytes object


def test_a_view_keeps_the_bytes_alive() -> None:
    data, view = inplace_bytes.allocate(4096)
    rows = view[8:].view(np.float32)  # a derived view, as the look-up writes through
    del view
    gc.collect()
    with_view = sys.getrefcount(data)
    rows[:] = 2.5
    assert np.frombuffer(data, dtype=np.float32, offset=8).tolist() == rows.tolist()
    del rows
    gc.collect()
    # The derived view alone held one reference to the bytes (through the view it came
    # from); without it, only our name is left.
    assert sys.getrefcount(data) == with_view - 1 == 2


def test_each_allocation_is_a_new_object_with_ordinary_references() -> None:
    first, _ = inplace_bytes.allocate(16)
    second, _ = inplace_bytes.allocate(16)
    assert first is not second
    lone, lone_view = inplace_bytes.allocate(32)
    del lone_view
    # Only our name (and getrefcount's argument) refer to it: no reference leaked.
    assert sys.getrefcount(lone) == 2


def test_a_size_that_cannot_be_a_response_is_a_bug() -> None:
    with pytest.raises(ValueError, match="this is a bug"):
        inplace_bytes.allocate(0)


# --- SpareBytes: the latest answer's bytes, filled again once nobody holds them


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="CPython's layout only")
def test_on_cpython_both_self_checks_pass() -> None:
    # Else a server here silently copies (or allocates afresh) every answer.
    assert inplace_bytes.available()
    assert inplace_bytes.reusable()


def _resident_bytes() -> int:
    # Freed memory may sit in glibc's heap (an earlier test may have raised the mmap
    # threshold in this process): hand it back first, so only live memory counts.
    release_free_memory()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_a_free_spare_of_the_same_size_is_filled_again() -> None:
    spare = inplace_bytes.SpareBytes()
    data, view = spare.allocate(4096)
    view[:] = 1
    first = id(data)
    del data, view
    again, view = spare.allocate(4096)
    assert id(again) == first  # the spare kept it alive: the same object came back
    view[:] = 7
    assert again == b"\x07" * 4096  # and it is written through the new view


def test_a_spare_anyone_still_holds_is_never_filled_again() -> None:
    spare = inplace_bytes.SpareBytes()
    sent, view = spare.allocate(4096)
    view[:] = 1
    del view  # as after finish(): the answer is held by gRPC, say, not by a view
    other, other_view = spare.allocate(4096)
    assert other is not sent
    other_view[:] = 2
    assert sent == b"\x01" * 4096  # untouched


def test_a_spare_someone_hashed_is_not_filled_again() -> None:
    spare = inplace_bytes.SpareBytes()
    data, view = spare.allocate(4096)
    view[:] = 1
    hash(data)  # its cached hash would be stale after a refill
    first = id(data)
    del data, view
    assert id(spare.allocate(4096)[0]) != first


def test_the_spare_is_let_go_before_another_size_and_when_idle() -> None:
    size = 64 << 20
    spare = inplace_bytes.SpareBytes()
    before = _resident_bytes()
    data, view = spare.allocate(size)
    view[:] = 1  # resident now
    del data, view
    assert spare.held_bytes == size
    assert _resident_bytes() - before > size // 2
    small, small_view = spare.allocate(4096)  # another size: the big spare goes first
    assert spare.held_bytes == 4096
    assert _resident_bytes() - before < size // 2
    del small_view
    spare.release_idle()
    assert spare.held_bytes == 4096  # in use (we hold it): kept
    del small
    spare.allocate(4096)  # taken again (and dropped at once)
    spare.release_idle()
    assert spare.held_bytes == 4096  # free, but taken since the last call: kept
    spare.release_idle()
    assert spare.held_bytes == 0  # untouched for a whole interval: let go


def test_a_free_spare_is_let_go_before_new_bytes_are_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spare = inplace_bytes.SpareBytes()
    spare.allocate(4096)  # dropped at once: a free spare of 4096 bytes
    held_when_allocating: list[int] = []
    allocate = inplace_bytes.allocate

    def recording(size: int) -> tuple[bytes, np.ndarray]:
        held_when_allocating.append(spare.held_bytes)
        return allocate(size)

    monkeypatch.setattr(inplace_bytes, "allocate", recording)
    spare.allocate(8192)
    assert held_when_allocating == [0]  # never both at once


def test_a_spare_seen_through_a_surviving_view_is_not_filled_again() -> None:
    spare = inplace_bytes.SpareBytes()
    data, view = spare.allocate(4096)
    rows = view[16:].view(np.float32)  # as a look-up thread still writing would hold
    first = id(data)
    del data, view
    other, _ = spare.allocate(4096)
    assert id(other) != first
    rows[:] = 1.0  # still writes into its own bytes, not the new answer's
    assert other != bytes(np.full(1020, 1.0, dtype=np.float32).data)


def test_release_lets_a_free_spare_go_at_once_but_never_one_in_use() -> None:
    spare = inplace_bytes.SpareBytes()
    data = spare.allocate(4096)[0]
    spare.release()
    assert spare.held_bytes == 4096  # we hold it
    del data
    spare.release()
    assert spare.held_bytes == 0
