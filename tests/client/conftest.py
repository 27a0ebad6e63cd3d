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
from client_support import PAD_D, PAD_ID, PAD_SEED, PAD_V, HeldServer, LoadingServer

from support.models import reference_rows
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


@pytest.fixture(scope="session")
def pad_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """V=50, D=16, seed 3, padding id 7 whose row is the seeded random row, not zeros."""
    from tokembed.export.module import TokenEmbedding, random_table
    from tokembed.export.onnx_export import ExportOptions, export_model

    out_dir = tmp_path_factory.mktemp("pad-model") / "model"
    table = random_table(PAD_V, PAD_D, PAD_SEED, padding_idx=None)  # row 7 left as drawn
    module = TokenEmbedding(PAD_V, PAD_D, padding_idx=PAD_ID, weight=table)
    export_model(module, ExportOptions(out_dir=out_dir, name="padded", seed=PAD_SEED))
    return out_dir


@pytest.fixture(scope="session")
def pad_rows() -> np.ndarray:
    """The padded model's answer for each id, computed independently of its export."""
    rows = reference_rows(PAD_V, PAD_D, PAD_SEED)
    assert np.all(rows[PAD_ID] != 0)  # what the model is for
    return rows


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
