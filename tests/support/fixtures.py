"""Fixtures shared by every test package (loaded with ``-p support.fixtures``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from support.models import build_default_model_dir, export_model_dir, reference_rows
from support.server import ServerThread

SMALL_V, SMALL_D, SMALL_SEED, SMALL_PAD = 1000, 64, 1, 0
DEFAULT_V, DEFAULT_D, DEFAULT_SEED = 32000, 512, 0


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """V=1000, D=64, seed 1, padding id 0: quick to export and to serve."""
    return export_model_dir(
        tmp_path_factory.mktemp("small-model") / "model",
        vocab_size=SMALL_V,
        d_model=SMALL_D,
        seed=SMALL_SEED,
        padding_idx=SMALL_PAD,
        name="small",
    )


@pytest.fixture(scope="session")
def small_loaded(small_model_dir: Path) -> Any:
    """The small model loaded as the server loads it (its tables too), once: tests build
    services around it and change nothing in it."""
    from tokembed.server.app import load_model
    from tokembed.server.settings import Settings

    return load_model(Settings(model_dir=small_model_dir))


@pytest.fixture(scope="session")
def small_rows() -> Any:
    """The small model's answer for each id (E[id] * sqrt(D), the reference)."""
    return reference_rows(SMALL_V, SMALL_D, SMALL_SEED, SMALL_PAD)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in default: V=32000, D=512, seed 0 (the design document's figures), built
    as ``tokembed serve`` builds it; ``support.models.default_rows`` holds its answers."""
    return build_default_model_dir(tmp_path_factory.mktemp("default-model") / "model")


@pytest.fixture
def start_server() -> Iterator[Callable[..., ServerThread]]:
    """Start real servers (in threads, port 0); all are stopped after the test."""
    from tokembed.server.settings import Settings

    started: list[ServerThread] = []

    def start(
        model_dir: Path, *, wait_ready: bool = True, loader: Any = None, **overrides: Any
    ) -> ServerThread:
        settings = Settings(model_dir=model_dir, port=0, metrics_port=0, **overrides).validate()
        server = ServerThread(settings) if loader is None else ServerThread(settings, loader=loader)
        started.append(server)
        return server.start(wait_ready=wait_ready)

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def fresh_allocations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every in-place response bytes object allocated afresh (not reused
    from a SpareBytes), while the test runs."""
    from tokembed.server import inplace_bytes

    sizes: list[int] = []
    allocate = inplace_bytes.allocate

    def counting(size: int) -> tuple[bytes, Any]:
        sizes.append(size)
        return allocate(size)

    monkeypatch.setattr(inplace_bytes, "allocate", counting)
    return sizes
