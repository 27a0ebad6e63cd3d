"""In-place bytes: a real ``bytes`` object, filled through a numpy view, kept alive by it."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest

from tokembed.server import inplace_bytes

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
