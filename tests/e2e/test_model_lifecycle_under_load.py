"""What happens around a load or an unload while requests flow: an unload under load (the
admitted requests finish on the model, new ones are refused with a clear status, nothing
else fails), a stop (SIGTERM's path) while a load is under way (the server ends within
its grace, the load's caller gets an answer), and a load of one model while another is
being swapped (models load side by side; the swapped one serves its old version until
the new one is ready)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokembed.client import EmbeddingClient, ModelNotFoundError, UnavailableError
from tokembed.server.models.loading import LoadedModel, load_model
from tokembed.server.process.settings import Settings

from support.backends import Gate, HookedLoader
from support.fixtures import SMALL_D, SMALL_PAD, SMALL_SEED, SMALL_V
from support.models import export_model_dir, reference_rows
from support.repository import put_version
from support.server import wait_for

MODEL = "small"
V2_SEED = SMALL_SEED + 10


@pytest.fixture(scope="module")
def version_2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_model_dir(
        tmp_path_factory.mktemp("lifecycle-v2") / "model",
        vocab_size=SMALL_V, d_model=SMALL_D, seed=V2_SEED, padding_idx=SMALL_PAD,
        name=MODEL, version="2",
    )  # fmt: skip


def test_an_unload_under_load_finishes_what_was_admitted_and_refuses_the_rest_clearly(
    tmp_path: Path, small_model_dir: Path, start_server: Any, small_rows: np.ndarray
) -> None:
    put_version(tmp_path, MODEL, 1, small_model_dir)
    loader = HookedLoader()
    server = start_server(
        (), model_repository=tmp_path, load_model=(MODEL,), loader=loader,
        inline_compute_max_tokens=0, grace_s=30,
    )  # fmt: skip
    served, refused, others = [0], [0], []
    stop = threading.Event()

    def caller(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with EmbeddingClient(server.target, timeout_s=30, retries=0) as client:
            while not stop.is_set():
                ids = rng.integers(0, SMALL_V, size=(1, 4))
                try:
                    hidden = client.embed(ids)
                    np.testing.assert_array_equal(hidden, small_rows[ids])
                    served[0] += 1
                except ModelNotFoundError as exc:
                    assert "is unloaded" in str(exc), exc
                    refused[0] += 1
                except BaseException as exc:
                    others.append(exc)
                    return

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for thread in callers:
        thread.start()
    control = EmbeddingClient(server.target, timeout_s=30)
    try:
        assert wait_for(lambda: served[0] >= 100 or others, 30)
        # Requests held in their look-ups when the unload comes (the callers' and one of
        # the test's): each must finish with its rows.
        loader.look_up_gate.close()
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(control.embed, [[11, 12, 13]])
            assert loader.look_up_gate.held.wait(10)
            time.sleep(0.2)  # the callers' next requests held too
            control.unload_model(MODEL)
            with pytest.raises(ModelNotFoundError, match="is unloaded"):
                control.embed([[1]])
            assert [(m.state, m.reason) for m in control.repository_index()] == [("UNLOADING", "")]
            time.sleep(0.2)
            assert not held.done()
            loader.look_up_gate.open()
            np.testing.assert_array_equal(held.result(30), small_rows[[[11, 12, 13]]])
        assert wait_for(lambda: refused[0] >= 20 or others, 30)
        assert wait_for(
            lambda: [m.state for m in control.repository_index()] == ["UNAVAILABLE"], 30
        )
    finally:
        loader.look_up_gate.open()
        stop.set()
        for thread in callers:
            thread.join(30)
        control.close()
    assert others == [], others[:3]
    assert served[0] >= 100 and refused[0] >= 20
    assert server.metric("tokembed_model_unloads_total", {"outcome": "unloaded"}) == 1


class _HeldLoader:
    """Loads for real; a load of a directory under ``held_under`` waits at ``gate``."""

    def __init__(self, held_under: Path) -> None:
        self.held_under = held_under
        self.gate = Gate(open=False)

    def __call__(self, directory: Path, settings: Settings) -> LoadedModel:
        loaded = load_model(directory, settings)
        if directory.is_relative_to(self.held_under):
            self.gate.pass_through()
        return loaded


def test_a_stop_during_a_load_ends_within_the_grace_and_answers_the_load(
    tmp_path: Path, small_model_dir: Path, version_2_dir: Path, start_server: Any
) -> None:
    put_version(tmp_path, MODEL, 1, small_model_dir)
    loader = _HeldLoader(tmp_path / MODEL / "2")
    server = start_server(
        (), model_repository=tmp_path, load_model=(MODEL,), loader=loader, grace_s=3
    )  # fmt: skip
    put_version(tmp_path, MODEL, 2, version_2_dir)
    control = EmbeddingClient(server.target, timeout_s=60, retries=0)
    try:
        with ThreadPoolExecutor(1) as pool:
            load = pool.submit(control.load_model, MODEL)  # version 2's, held
            assert loader.gate.held.wait(10)
            started = time.monotonic()
            server.stop(grace_s=3)
            assert time.monotonic() - started < 3 + 5  # the grace, and closing down
            with pytest.raises(UnavailableError, match=r"is stopping.*abandoned"):
                load.result(10)  # an answer, not a hang
    finally:
        loader.gate.open()
        control.close()


def test_a_load_of_one_model_while_another_is_swapped(
    tmp_path: Path, small_model_dir: Path, version_2_dir: Path, start_server: Any,
    small_rows: np.ndarray,
) -> None:  # fmt: skip
    v2_rows = reference_rows(SMALL_V, SMALL_D, V2_SEED, SMALL_PAD)
    put_version(tmp_path, "enc", 1, small_model_dir)
    put_version(tmp_path, "dec", 1, version_2_dir)
    loader = _HeldLoader(tmp_path / "enc" / "2")
    server = start_server(
        (), model_repository=tmp_path, load_model=("enc",), loader=loader, grace_s=10
    )  # fmt: skip
    ids = [[3, 4, 5]]
    with EmbeddingClient(server.target, timeout_s=30) as client, ThreadPoolExecutor(2) as pool:
        put_version(tmp_path, "enc", 2, version_2_dir)
        swap = pool.submit(client.load_model, "enc")  # held in its load
        assert loader.gate.held.wait(10)
        # Meanwhile: enc serves version 1 still; dec loads and serves beside it; a second
        # load of enc waits for the first, and fails nothing.
        again = pool.submit(client.load_model, "enc")
        client.load_model("dec")
        result = client.embed_result(ids, model="enc")
        assert result.model_version == "1"
        np.testing.assert_array_equal(result.hidden_states, small_rows[ids])
        np.testing.assert_array_equal(client.embed(ids, model="dec"), v2_rows[ids])
        states = {(m.name, m.version): m.state for m in client.repository_index()}
        assert states == {("dec", "1"): "READY", ("enc", "1"): "READY", ("enc", "2"): "LOADING"}
        assert not swap.done() and not again.done()
        loader.gate.open()
        swap.result(30)
        again.result(30)  # the model unchanged by then: nothing more to do
        result = client.embed_result(ids, model="enc")
        assert result.model_version == "2"
        np.testing.assert_array_equal(result.hidden_states, v2_rows[ids])
    assert server.metric("tokembed_model_loads_total", {"model": "enc", "version": "2"}) == 1


def test_an_unloaded_version_is_let_go_at_once_not_when_the_collector_runs(
    tmp_path: Path, small_model_dir: Path, version_2_dir: Path, start_server: Any
) -> None:
    """Its tables go when its last request is answered: no reference cycle (the
    scheduler's admission, a finished call's callbacks) keeps them until Python's cyclic
    collector happens to run, which under steady traffic can be never."""
    import gc
    import weakref

    put_version(tmp_path, MODEL, 1, small_model_dir)
    server = start_server((), model_repository=tmp_path, load_model=(MODEL,))
    (version_1,) = list(server.server.repository)
    backend = weakref.ref(version_1.served.backend)
    del version_1
    gc.collect()
    gc.disable()
    try:
        with EmbeddingClient(server.target) as client:
            for _ in range(20):
                client.embed([[1, 2, 3]])
            put_version(tmp_path, MODEL, 2, version_2_dir)
            client.load_model(MODEL)
            assert client.embed_result([[1, 2, 3]]).model_version == "2"
            assert wait_for(lambda: backend() is None, 10), "version 1's backend is still held"
    finally:
        gc.enable()
