"""Fixtures of the metrics tests: a valve in front of the runtime, and a server behind it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from metrics_helpers import VALVED, Valve, valved_loader

from support.server import ServerThread


@pytest.fixture
def valve(start_server: Callable[..., ServerThread]) -> Iterator[Valve]:
    # Set up after start_server, so torn down before it: the valve opens before any
    # server stops, and no look-up is left hanging for the stop to wait on.
    valve = Valve()
    yield valve
    valve.open()


@pytest.fixture
def start_valved(
    small_model_dir: Path, start_server: Callable[..., ServerThread], valve: Valve
) -> Callable[..., ServerThread]:
    """Start the small model's server with ``valve`` in front of its runtime."""

    def start(**overrides: Any) -> ServerThread:
        return start_server(small_model_dir, loader=valved_loader(valve), **{**VALVED, **overrides})

    return start
