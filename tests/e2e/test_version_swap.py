"""Swapping a model's version while it serves: version 2 loaded beside version 1, new
requests routed to 2 at once, version 1 unloaded when its last admitted request has been
answered. Through the real server and client, for both backends.

Two versions of the model "small" (same V and D, different tables): every answer says
which version made it (``model_version``) and must equal that version's rows exactly, so
an answer mixing the tables, or one claiming the wrong version, fails.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokembed.client import AsyncEmbeddingClient, EmbeddingClient, ModelNotFoundError
from tokembed.server.core.repository import ModelState

from support.backends import Gate, HookedLoader
from support.fixtures import EVERY_BACKEND, SMALL_D, SMALL_PAD, SMALL_SEED, SMALL_V
from support.models import export_model_dir, reference_rows
from support.requests import embed_request, stub_for
from support.server import ServerThread, wait_for

V2_SEED = SMALL_SEED + 10
# The load: this many callers, each sending requests of a few ids until told to stop.
CALLERS = 16
LOAD_LIMIT_S = 60.0  # a bound on the whole load, should the swap never finish


@pytest.fixture(scope="module")
def version_2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small model's second version: the same name, V and D, another table."""
    return export_model_dir(
        tmp_path_factory.mktemp("small-v2") / "model",
        vocab_size=SMALL_V, d_model=SMALL_D, seed=V2_SEED, padding_idx=SMALL_PAD,
        name="small", version="2",
    )  # fmt: skip


@pytest.fixture(scope="module")
def rows(small_rows: np.ndarray) -> dict[str, np.ndarray]:
    """Each version's answer for each id, computed independently of its export."""
    return {"1": small_rows, "2": reference_rows(SMALL_V, SMALL_D, V2_SEED, SMALL_PAD)}


def _check(rows: dict[str, np.ndarray], ids: np.ndarray, hidden: np.ndarray, version: str) -> None:
    np.testing.assert_array_equal(hidden, rows[version][ids])


@EVERY_BACKEND
def test_a_version_swap_under_load_fails_no_request_and_every_answer_is_one_version_s(
    small_model_dir: Path,
    version_2_dir: Path,
    start_server: Any,
    rows: dict[str, np.ndarray],
    backend: dict[str, Any],
) -> None:
    server: ServerThread = start_server(small_model_dir, **backend)
    assert server.server is not None
    app = server.server
    answers: dict[str, int] = {"1": 0, "2": 0}
    failures: list[BaseException] = []
    stop = asyncio.Event()
    swapped_at: list[int] = []  # answers counted when the swap had completed

    async def caller(index: int) -> None:
        rng = np.random.default_rng(index)
        async with AsyncEmbeddingClient(server.target, timeout_s=30) as client:
            while not stop.is_set():
                ids = rng.integers(0, SMALL_V, size=(2, 3))
                try:
                    result = await client.embed_result(ids)
                    _check(rows, ids, result.hidden_states, result.model_version)
                except BaseException as exc:  # every failure is the test's business
                    failures.append(exc)
                    return
                answers[result.model_version] += 1

    async def load() -> None:
        callers = [asyncio.ensure_future(caller(i)) for i in range(CALLERS)]
        try:
            await asyncio.wait_for(stop.wait(), LOAD_LIMIT_S)
        finally:
            stop.set()
            await asyncio.gather(*callers, return_exceptions=True)

    loop = asyncio.new_event_loop()
    load_thread = threading.Thread(target=loop.run_until_complete, args=(load(),))
    load_thread.start()
    try:
        # Version 1 serves under load first; then the swap, then version 2 alone.
        assert wait_for(lambda: answers["1"] >= 200 or failures, 30)
        handle = server.call(app.load(version_2_dir))
        assert handle.version == "2"
        server.call(app.unload("small", "1"))
        swapped_at.append(sum(answers.values()))
        assert wait_for(lambda: answers["2"] >= 200 or failures, 30)
    finally:
        loop.call_soon_threadsafe(stop.set)
        load_thread.join(LOAD_LIMIT_S + 10)
        loop.close()
    assert failures == [], failures[:3]
    assert answers["1"] >= 200 and answers["2"] >= 200, answers
    # Version 1 is gone: only version 2 is served, and asking for 1 by name is refused.
    assert [(h.version, h.state) for h in app.repository] == [("2", ModelState.READY)]
    with EmbeddingClient(server.target) as client:
        assert client.info().version == "2"
        result = client.embed_result([[5, 6, 7]])
        assert result.model_version == "2"
        _check(rows, np.array([[5, 6, 7]]), result.hidden_states, "2")
    with pytest.raises(ModelNotFoundError, match="no version '1'"):
        _ask_for_version(server, "1")


def _ask_for_version(server: ServerThread, version: str) -> None:
    """An Embed naming ``version`` of "small", through the raw stub (the client's embed
    names no version)."""
    import grpc

    from tokembed.client.errors import from_rpc_error

    request = embed_request([[5]], model_name="small", model_version=version)
    with stub_for(server.target) as stub:
        try:
            stub.Embed(request, timeout=10)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc


def test_the_old_version_is_unloaded_only_when_its_last_request_is_answered(
    small_model_dir: Path, version_2_dir: Path, start_server: Any, rows: dict[str, np.ndarray]
) -> None:
    """A request admitted on version 1 (held at its look-up) finishes on version 1 after
    the swap; the unload waits for it, and new requests meanwhile go to version 2."""
    loader = HookedLoader()
    server: ServerThread = start_server(small_model_dir, loader=loader, inline_compute_max_tokens=0)
    app = server.server
    assert app is not None
    v1 = loader.backends["small"]
    loader.look_up_gate.close()  # version 1's next look-up waits
    v1.entered.clear()
    with EmbeddingClient(server.target, timeout_s=30) as held_client:
        held = server.submit(_embed_in_thread(server, held_client, [[11, 12]]))
        assert v1.entered.wait(10), "the request never reached version 1's look-up"
        v1_gate, loader.look_up_gate = loader.look_up_gate, Gate()  # version 2's look-ups pass
        server.call(app.load(version_2_dir))
        unload = server.submit(app.unload("small", "1"))
        with EmbeddingClient(server.target, timeout_s=30) as client:
            result = client.embed_result([[11, 12]])
        assert result.model_version == "2"
        _check(rows, np.array([[11, 12]]), result.hidden_states, "2")
        time.sleep(0.2)  # the unload had every chance to finish early; it must not
        assert not unload.done(), "version 1 was unloaded with a request still on it"
        (version_1,) = [h for h in app.repository if h.version == "1"]
        assert version_1.state is ModelState.DRAINING and version_1.leases == 1
        v1_gate.open()
        version, hidden = held.result(30)
        assert version == "1"
        _check(rows, np.array([[11, 12]]), hidden, "1")
        unload.result(30)
        assert version_1.state is ModelState.UNLOADED and version_1.leases == 0


async def _embed_in_thread(
    server: ServerThread, client: EmbeddingClient, ids: list[list[int]]
) -> tuple[str, np.ndarray]:
    """The blocking client's call, off the server's loop (submitted there only to get a
    future)."""
    result = await asyncio.get_running_loop().run_in_executor(None, client.embed_result, ids)
    return result.model_version, result.hidden_states
