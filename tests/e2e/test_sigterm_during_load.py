"""SIGTERM to a real ``tokembed serve`` process while a model loads: the load's caller gets
a clear UNAVAILABLE at once, the requests in flight on a model already served finish, and
the process exits 0 within its grace (the load under way does not hold it to its end).

The in-process stop (test_model_lifecycle_under_load) cannot see the last part: what a
process waits for at its exit. The load is made slow by its size alone, nothing in the
server is hooked: a table of many short rows, whose per-row work makes loading take
seconds while its files stay small and quick to export.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from tokembed.client import EmbeddingClient, UnavailableError
from tokembed.v1 import embedding_pb2_grpc

from support.fixtures import DEFAULT_V
from support.metrics import scrape, total, workers_ready
from support.models import export_model_dir
from support.ports import free_ports
from support.repository import put_version
from support.requests import embed_request
from support.server import ServerProcess, wait_for

SERVED, SLOW = "served", "slow"
GRACE_S = 2.0
# Closing down after the grace: gRPC's stop, the loop's end, the interpreter's exit.
MARGIN_S = 3.0
# Rows enough that loading takes well over GRACE_S + MARGIN_S on its own, so a process
# that waits for the load at its exit fails the bound.
SLOW_V, SLOW_D = 2_500_000, 4


@pytest.fixture(scope="module")
def slow_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_model_dir(
        tmp_path_factory.mktemp("slow-load") / "model",
        vocab_size=SLOW_V, d_model=SLOW_D, seed=3, name=SLOW,
    )  # fmt: skip


def test_sigterm_during_a_load_answers_it_finishes_what_is_in_flight_and_exits_within_the_grace(
    tmp_path: Path, default_model_dir: Path, default_rows: np.ndarray, slow_model_dir: Path
) -> None:
    put_version(tmp_path, SERVED, 1, default_model_dir)
    put_version(tmp_path, SLOW, 1, slow_model_dir)
    server = ServerProcess([
        "--model-repository", str(tmp_path), "--model-control-mode", "explicit",
        "--load-model", SERVED, "--grace-s", str(GRACE_S), "--port", "0",
        "--metrics-port", "0",
    ]).start()  # fmt: skip
    control = EmbeddingClient(server.target, timeout_s=60, retries=0)
    try:
        ids = (np.arange(32 * 512) % DEFAULT_V).reshape(32, 512)  # ~34 MB answers
        with ThreadPoolExecutor(1) as pool, grpc.insecure_channel(server.target) as channel:
            # In flight on the model served until the signal has landed: an EmbedChunked
            # answer read only afterwards (flow control holds the server's sending once
            # this reader's window is full, far short of 34 MB).
            held = embedding_pb2_grpc.EmbeddingServiceStub(channel).EmbedChunked(
                embed_request(ids, model_name=SERVED), timeout=60
            )
            header = next(held).header.hidden_states
            load = pool.submit(control.load_model, SLOW)
            assert wait_for(lambda: _state(control, SLOW) == "LOADING", 30), server.output
            signalled = time.monotonic()
            server.send_signal(signal.SIGTERM)
            with pytest.raises(UnavailableError, match=r"is stopping.*abandoned"):
                load.result(GRACE_S + MARGIN_S)  # an answer, not a hang or a time-out
            data = b"".join(chunk.data for chunk in held)
        assert server.wait(60) == 0, server.output
        took = server.exited_at - signalled
        assert took <= GRACE_S + MARGIN_S, f"exited {took:.1f}s after SIGTERM\n{server.output}"
        got = np.frombuffer(data, "<f4").reshape(list(header.shape))
        np.testing.assert_array_equal(got, default_rows[ids])
        # The load was abandoned, not finished before the signal or the exit.
        assert f"loaded model {SLOW}" not in server.output
        assert "signal received: draining" in server.output
    finally:
        control.close()
        server.kill()


def _state(control: EmbeddingClient, name: str) -> str:
    states = [m.state for m in control.repository_index() if m.name == name]
    return states[0] if states else ""


def test_sigterm_to_workers_during_a_load_exits_every_worker_within_the_grace(
    tmp_path: Path, default_model_dir: Path, slow_model_dir: Path
) -> None:
    """``--workers 2`` in poll mode (explicit control needs one process): a new model
    copied into the repository, each worker loading it, and SIGTERM to the parent, which
    forwards it: the parent, which waits for every worker, exits 0 within the grace, the
    loads abandoned."""
    put_version(tmp_path, SERVED, 1, default_model_dir)
    port, metrics_base, _ = free_ports(3, consecutive=True)
    process = subprocess.Popen(
        [sys.executable, "-m", "tokembed.cli", "serve", "--model-repository", str(tmp_path),
         "--model-control-mode", "poll", "--repository-poll-secs", "0.2", "--workers", "2",
         "--grace-s", str(GRACE_S), "--port", str(port), "--metrics-port", str(metrics_base)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert wait_for(lambda: workers_ready(metrics_base, 2), 60, 0.2)
        put_version(tmp_path, SLOW, 1, slow_model_dir)

        def both_loading() -> bool:
            states = []
            for i in range(2):
                text = scrape(metrics_base + i)
                states.append(
                    total(text, "tokembed_model_state", {"model": SLOW, "state": "LOADING"})
                )
            return all(state == 1 for state in states)

        assert wait_for(both_loading, 30, 0.05)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        took = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    assert took <= GRACE_S + MARGIN_S, f"exited {took:.1f}s after SIGTERM\n{stderr}"
    assert f"loaded model {SLOW}" not in stderr
