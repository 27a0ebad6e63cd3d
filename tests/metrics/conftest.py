"""Fixtures of the metrics tests: a valve in front of the runtime, and a server behind it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from support.backends import HOLDABLE, Gate, HookedLoader
from support.server import ServerThread


@pytest.fixture
def valve(start_server: Callable[..., ServerThread]) -> Iterator[Gate]:
    """A gate in front of the runtime's look-ups (support.backends): ``close()``, then send
    a request: its batch starts computing and stops inside the runtime (``held`` is set),
    so whatever is sent next waits in the batcher's queue, deterministically, until
    ``open()``."""
    # Set up after start_server, so torn down before it: the valve opens before any
    # server stops, and no look-up is left hanging for the stop to wait on.
    valve = Gate()
    yield valve
    valve.open()


@pytest.fixture
def start_valved(
    small_model_dir: Path, start_server: Callable[..., ServerThread], valve: Gate
) -> Callable[..., ServerThread]:
    """Start the small model's server with ``valve`` in front of its runtime."""

    def start(**overrides: Any) -> ServerThread:
        loader = HookedLoader(look_up_gate=valve)
        return start_server(small_model_dir, loader=loader, **{**HOLDABLE, **overrides})

    return start
