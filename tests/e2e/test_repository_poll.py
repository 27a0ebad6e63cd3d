"""Poll mode (``--model-control-mode poll``): while callers send requests without pause,
the repository changes on disk and the server follows: a version copied in is served, a
half-copied one waits for its last bytes (then is served), one whose bytes do not match
its manifest's sha256 is never served and says why, a removed version gives way to the
one before it, a removed model is unloaded. No request fails but those to the removed
model, and every answer equals the rows of the version that made it.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokembed.client import EmbeddingClient, ModelNotFoundError, RepositoryModel

from support.fixtures import SMALL_D, SMALL_PAD, SMALL_SEED, SMALL_V
from support.models import export_model_dir, reference_rows
from support.repository import finish_copy, half_copied, hash_mismatch, put_version
from support.server import wait_for

MODEL = "small"
V2_SEED = SMALL_SEED + 10
POLL_S = 0.1
LIMIT_S = 30.0  # for each change to be picked up


@pytest.fixture(scope="module")
def version_2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_model_dir(
        tmp_path_factory.mktemp("poll-v2") / "model",
        vocab_size=SMALL_V, d_model=SMALL_D, seed=V2_SEED, padding_idx=SMALL_PAD,
        name=MODEL, version="2",
    )  # fmt: skip


def test_poll_mode_follows_the_repository_under_load(
    tmp_path: Path, small_model_dir: Path, version_2_dir: Path, start_server: Any,
    small_rows: np.ndarray,
) -> None:  # fmt: skip
    v2_rows = reference_rows(SMALL_V, SMALL_D, V2_SEED, SMALL_PAD)
    # Versions 1 and 3 are the small model's table, 2 and 4 the second one's.
    rows = {"1": small_rows, "2": v2_rows, "3": small_rows, "4": v2_rows}
    repository = tmp_path / "models"
    put_version(repository, MODEL, 1, small_model_dir)
    server = start_server(
        (), model_repository=repository, model_control_mode="poll",
        repository_poll_secs=POLL_S,
    )  # fmt: skip
    answers: dict[str, int] = {}
    failures: list[BaseException] = []
    stop = threading.Event()

    def caller(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with EmbeddingClient(server.target, timeout_s=30) as client:
            while not stop.is_set():
                ids = rng.integers(0, SMALL_V, size=(2, 3))
                try:
                    result = client.embed_result(ids)
                    np.testing.assert_array_equal(
                        result.hidden_states, rows[result.model_version][ids]
                    )
                except BaseException as exc:
                    failures.append(exc)
                    return
                answers[result.model_version] = answers.get(result.model_version, 0) + 1

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for thread in callers:
        thread.start()
    index_client = EmbeddingClient(server.target)

    def index() -> list[RepositoryModel]:
        return index_client.repository_index()

    def serving(version: str) -> bool:
        ready = [m.version for m in index() if m.state == "READY"]
        return ready == [version] and answers.get(version, 0) >= 20

    try:
        assert wait_for(lambda: serving("1") or failures, LIMIT_S)
        # Copied in: picked up.
        put_version(repository, MODEL, 2, version_2_dir)
        assert wait_for(lambda: serving("2") or failures, LIMIT_S), (index(), failures)
        # Half copied: waits, what serves serves on; once complete: served.
        half = half_copied(repository, MODEL, 3, small_model_dir)
        assert wait_for(lambda: "3" in {m.version for m in index()}, LIMIT_S)
        time.sleep(5 * POLL_S)
        (v3,) = [m for m in index() if m.version == "3"]
        assert v3.state == "UNAVAILABLE" and "still being copied" in v3.reason, v3
        assert serving("2")
        finish_copy(half, small_model_dir)
        assert wait_for(lambda: serving("3") or failures, LIMIT_S), (index(), failures)
        # Its bytes are not its manifest's: never served, the reason in the index.
        hash_mismatch(repository, MODEL, 4, version_2_dir)
        assert wait_for(lambda: any("sha256" in m.reason for m in index()), LIMIT_S), index()
        time.sleep(5 * POLL_S)
        assert serving("3")
        loads = server.metric("tokembed_model_loads_total", {"version": "4", "outcome": "failed"})
        assert loads == 1  # tried once, not at every poll
        # Removed: the latest version left is served again.
        shutil.rmtree(repository / MODEL / "4")
        shutil.rmtree(repository / MODEL / "3")
        assert wait_for(lambda: serving("2") or failures, LIMIT_S), (index(), failures)
        assert failures == [], failures[:3]
        # The model removed: unloaded, its requests refused with the reason.
        stop.set()
        for thread in callers:
            thread.join(30)
        shutil.rmtree(repository / MODEL)
        assert wait_for(lambda: index() == [], LIMIT_S), index()
        with pytest.raises(ModelNotFoundError, match="removed from the repository"):
            index_client.embed([[1, 2]])
    finally:
        stop.set()
        for thread in callers:
            thread.join(30)
        index_client.close()
    assert failures == [], failures[:3]
    assert {version for version, count in answers.items() if count} == {"1", "2", "3"}
