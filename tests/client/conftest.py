"""Fixtures for the client's tests.

The client is tested against the real server (tests/support: ``start_server``, the small
and decoder models, their reference rows), started per test on a free loopback port. The
scripted fake of client_fakes.py serves only the cases its docstring names, which a real
server cannot produce.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from client_fakes import FakeServer, start_fake_server
from client_support import HeldServer, LoadingServer

from support.server import ServerThread


@pytest.fixture
def real_server(start_server: Callable[..., ServerThread], small_model_dir: Path) -> ServerThread:
    """The real server with its default settings, serving the small model (V=1000, D=64,
    padding id 0; its answers: the ``small_rows`` fixture)."""
    return start_server(small_model_dir)


@pytest.fixture
def two_models(
    start_server: Callable[..., ServerThread], small_model_dir: Path, decoder_model_dir: Path
) -> ServerThread:
    """The real server serving "small" (the default, D=64) and "decoder" (D=24)."""
    return start_server((small_model_dir, decoder_model_dir))


@pytest.fixture
def held(
    start_server: Callable[..., ServerThread], small_model_dir: Path, small_rows: np.ndarray
) -> Iterator[HeldServer]:
    """The real server with every look-up held at a gate (see HeldServer); its requests
    carry at most 64 tokens, so that too_large is as easy to reach as overloaded."""
    held = HeldServer(start_server, small_model_dir, small_rows, max_tokens_per_request=64)
    yield held
    held.close()


@pytest.fixture
def loading(
    start_server: Callable[..., ServerThread], small_model_dir: Path, decoder_model_dir: Path
) -> Iterator[LoadingServer]:
    """The real server with "small" and "decoder" still loading until finish_loading()."""
    server = LoadingServer(start_server, (small_model_dir, decoder_model_dir))
    yield server
    server.close()


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    """The scripted fake (client_fakes.py): only for what a real server cannot produce."""
    server = start_fake_server()
    yield server
    server.stop()
