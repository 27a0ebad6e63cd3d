"""Swaps under load: 32 callers (16 on tokembed.v1, 16 on the Open Inference Protocol
through tritonclient's asyncio client) send requests without pause while the model is
swapped 20 times between two versions with different tables, by RepositoryModelLoad
(tritonclient's ``load_model``, the version policy in its config). No request fails,
every answer equals exactly the rows of the version it says made it, and the p99
latency during the swaps is at most twice the steady one, measured in turns with them
(a steady window, a swap, a steady window...).

The server is a ``tokembed serve`` process (its event loop shares no GIL with the
callers'). Bounded: each phase by count and by time.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc.aio as tritonclient_aio

from tokembed.client import AsyncEmbeddingClient

from support.fixtures import SMALL_D, SMALL_PAD, SMALL_SEED, SMALL_V
from support.models import export_model_dir, reference_rows
from support.repository import put_version
from support.server import ServerProcess

MODEL = "small"
V2_SEED = SMALL_SEED + 10
CALLERS_PER_PROTOCOL = 16
SWAPS = 20
STEADY_S = 5.0  # in all, in windows between the swaps
AFTER_SWAP_S = 0.2  # what counts as during a swap: the load, and this long after it
PHASE_LIMIT_S = 120.0  # should the swaps never finish


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory, small_model_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("swaps") / "models"
    version_2 = export_model_dir(
        tmp_path_factory.mktemp("swaps-v2") / "model",
        vocab_size=SMALL_V, d_model=SMALL_D, seed=V2_SEED, padding_idx=SMALL_PAD,
        name=MODEL, version="2",
    )  # fmt: skip
    put_version(root, MODEL, 1, small_model_dir)
    put_version(root, MODEL, 2, version_2)
    return root


def only(version: int) -> str:
    return json.dumps({"version_policy": {"specific": {"versions": [version]}}})


def test_20_swaps_under_32_callers_fail_nothing_and_keep_p99_within_twice_steady(
    repository: Path, small_rows: np.ndarray
) -> None:
    rows = {"1": small_rows, "2": reference_rows(SMALL_V, SMALL_D, V2_SEED, SMALL_PAD)}
    server = ServerProcess([
        "--model-repository", str(repository), "--load-model", MODEL, "--port", "0",
        "--metrics-port", "-1", "--grace-s", "5",
    ])  # fmt: skip
    # --load-model with the default policy serves version 2; the swaps set their own.
    server.start()
    # The latencies are the server's to answer for, not this process's: late in a test
    # session this process's cyclic collector walks every object earlier tests left, a
    # pause that stalls all 32 callers at once wherever it falls (so, as timeit does,
    # the collector is off while they run).
    gc.collect()
    gc.disable()
    try:
        results = asyncio.run(_load_and_swap(server.target, rows))
    finally:
        gc.enable()
        server.send_signal()
        server.wait(30)
    failures, latencies, answers = results
    assert failures == [], failures[:3]
    steady, swapping = latencies["steady"], latencies["swaps"]
    assert len(steady) >= 1000 and len(swapping) >= 1000, (len(steady), len(swapping))
    assert answers["1"] >= 100 and answers["2"] >= 100, answers
    p99_steady, p99_swaps = np.percentile(steady, 99), np.percentile(swapping, 99)
    print(
        f"p99 steady {p99_steady * 1e3:.2f} ms, during swaps {p99_swaps * 1e3:.2f} ms, "
        f"ratio {p99_swaps / p99_steady:.2f}; requests {len(steady)} + {len(swapping)}"
    )
    assert p99_swaps <= 2 * p99_steady, (p99_steady, p99_swaps)


async def _load_and_swap(
    target: str, rows: dict[str, np.ndarray]
) -> tuple[list[BaseException], dict[str, list[float]], dict[str, int]]:
    failures: list[BaseException] = []
    latencies: dict[str, list[float]] = {"warm-up": [], "steady": [], "swaps": [], "after": []}
    answers = {"1": 0, "2": 0}
    phase = ["warm-up"]
    stop = asyncio.Event()

    def check(
        ids: np.ndarray, hidden: np.ndarray, version: str, started: float, sent_in: str
    ) -> None:
        latencies[sent_in].append(time.perf_counter() - started)
        np.testing.assert_array_equal(hidden, rows[version][ids])
        answers[version] += 1

    async def v1_caller(index: int) -> None:
        rng = np.random.default_rng(index)
        async with AsyncEmbeddingClient(target, timeout_s=30) as client:
            while not stop.is_set():
                ids = rng.integers(0, SMALL_V, size=(2, 3))
                started, sent_in = time.perf_counter(), phase[0]
                try:
                    result = await client.embed_result(ids)
                    check(ids, result.hidden_states, result.model_version, started, sent_in)
                except BaseException as exc:
                    failures.append(exc)
                    return

    async def v2_caller(index: int) -> None:
        from tritonclient.grpc import InferInput

        rng = np.random.default_rng(1000 + index)
        async with tritonclient_aio.InferenceServerClient(target) as client:
            while not stop.is_set():
                ids = rng.integers(0, SMALL_V, size=(2, 3))
                tensor = InferInput("input_ids", [2, 3], "INT64")
                tensor.set_data_from_numpy(ids.astype(np.int64))
                started, sent_in = time.perf_counter(), phase[0]
                try:
                    result = await client.infer(MODEL, [tensor], client_timeout=30)
                    version = result.get_response().model_version
                    check(ids, result.as_numpy("hidden_states"), version, started, sent_in)
                except BaseException as exc:
                    failures.append(exc)
                    return

    callers = [asyncio.ensure_future(v1_caller(i)) for i in range(CALLERS_PER_PROTOCOL)]
    callers += [asyncio.ensure_future(v2_caller(i)) for i in range(CALLERS_PER_PROTOCOL)]
    try:
        async with tritonclient_aio.InferenceServerClient(target) as control:
            await control.load_model(MODEL, config=only(1))
            await asyncio.sleep(1.0)  # the callers connected and warmed
            # In turns, so that whatever else the machine does weighs on both alike: a
            # steady window, then a swap (the load, and the requests after it); each
            # request counted in the window it was sent in.
            deadline = time.monotonic() + PHASE_LIMIT_S
            for swap in range(SWAPS):
                phase[0] = "steady"
                await asyncio.sleep(STEADY_S / SWAPS)
                phase[0] = "swaps"
                await control.load_model(MODEL, config=only(2 if swap % 2 == 0 else 1))
                await asyncio.sleep(AFTER_SWAP_S)
                if failures or time.monotonic() > deadline:
                    break
            phase[0] = "after"
            index = await control.get_model_repository_index()
            assert [(m.version, m.state) for m in index.models if m.state == "READY"] == [
                ("1", "READY")
            ], index
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*callers, return_exceptions=True), 60)
    return failures, latencies, answers
