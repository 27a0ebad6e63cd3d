"""The table cache through the real server: a server started again maps the tables the
first one wrote (it computes none), and unloading a model lets go of their mappings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tokembed.client import EmbeddingClient, ModelNotFoundError

from support.repository import put_version
from support.server import ServerProcess, wait_for

MODEL = "small"
IDS = np.array([[0, 1, 999, 5]], dtype=np.int64)


def _maps(server: ServerProcess) -> str:
    assert server.process is not None
    return Path(f"/proc/{server.process.pid}/maps").read_text()


def _serve(repository: Path, cache: Path) -> ServerProcess:
    return ServerProcess([
        "--model-repository", str(repository), "--model-control-mode", "explicit",
        "--load-model", MODEL, "--port", "0", "--metrics-port", "-1",
        "--table-cache-dir", str(cache),
    ]).start()  # fmt: skip


def test_a_restarted_server_maps_the_tables_and_unloading_unmaps_them(
    tmp_path: Path, small_model_dir: Path, small_rows: np.ndarray
) -> None:
    repository, cache = tmp_path / "models", tmp_path / "tables"
    put_version(repository, MODEL, 1, small_model_dir)
    first = _serve(repository, cache)
    try:
        with EmbeddingClient(first.target) as client:
            np.testing.assert_array_equal(client.embed(IDS), small_rows[IDS])
    finally:
        first.send_signal()
        first.wait(60)
    assert first.output.count("computed and written") == 3, first.output
    files = sorted(str(path) for path in cache.glob("*.rows"))
    assert len(files) == 3

    again = _serve(repository, cache)
    try:
        assert "computed and written" not in again.output, again.output
        assert all(path in _maps(again) for path in files)
        with EmbeddingClient(again.target) as client:
            np.testing.assert_array_equal(client.embed(IDS), small_rows[IDS])
            half = client.embed(IDS, "float16")
            np.testing.assert_array_equal(half, small_rows[IDS].astype(np.float16))
            client.unload_model(MODEL)
            assert wait_for(lambda: not any(path in _maps(again) for path in files), 30), _maps(
                again
            )
            with pytest.raises(ModelNotFoundError, match="unloaded"):
                client.embed(IDS)
    finally:
        again.send_signal()
        again.wait(60)
