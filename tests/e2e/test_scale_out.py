"""Scale-out from the client: round_robin over three real server processes, one of which
goes away mid-run without any caller seeing an error."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import numpy as np

from tokembed.client import EmbeddingClient

from support.fixtures import SMALL_V
from support.metrics import scrape, total
from support.server import ServerProcess, serve_args


def _served(server: ServerProcess) -> float:
    """Embed calls ``server`` answered OK, as its scrape shows them (parsed by
    prometheus_client, whatever the labels' order or number)."""
    ok = {"method": "Embed", "code": "OK", "model": "small"}
    return total(scrape(server.metrics_port, timeout_s=5), "tokembed_requests_total", ok)


def test_round_robin_spreads_over_three_servers_and_survives_losing_one(
    small_model_dir: Path, small_rows: np.ndarray
) -> None:
    servers: list[ServerProcess] = []
    try:
        # Each one killed in the end, even if a later one fails to start.
        for _ in range(3):
            servers.append(ServerProcess(serve_args(small_model_dir)))
            servers[-1].start()
        target = "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in servers)
        errors: list[BaseException] = []
        done = [0]
        lock = threading.Lock()
        with EmbeddingClient(
            target, load_balancing_policy="round_robin", retries=5, backoff_s=0.02,
            timeout_s=30,
        ) as client:  # fmt: skip

            def caller(offset: int, count: int) -> None:
                for index in range(count):
                    token = (offset * 1000 + index) % SMALL_V
                    try:
                        got = client.embed([[token, 1]])
                        np.testing.assert_array_equal(got, small_rows[[[token, 1]]])
                        with lock:
                            done[0] += 1
                    except BaseException as exc:
                        errors.append(exc)

            # round_robin picks among the connections already made: until all three are,
            # calls go to the first. Warm up until each server has answered one.
            deadline = time.monotonic() + 30
            while min(_served(s) for s in servers) == 0:
                assert time.monotonic() < deadline, [_served(s) for s in servers]
                client.embed([[1]])
            warm = [_served(s) for s in servers]

            # Phase 1: all three up; the load spreads over all of them.
            first = [threading.Thread(target=caller, args=(i, 40)) for i in range(4)]
            for thread in first:
                thread.start()
            for thread in first:
                thread.join(60)
            before = [_served(s) for s in servers]
            phase_1 = [b - w for b, w in zip(before, warm, strict=True)]
            assert sum(phase_1) == 160
            assert min(phase_1) > 0, f"round_robin left a server idle: {phase_1}"

            # Phase 2: load keeps running while one server is killed outright.
            second = [threading.Thread(target=caller, args=(10 + i, 60)) for i in range(4)]
            for thread in second:
                thread.start()
            while done[0] < 180 and not errors:  # the load is under way...
                threading.Event().wait(0.005)
            victim = servers[1]
            victim.send_signal(signal.SIGKILL)  # ...when one replica dies
            assert done[0] < 400
            victim.wait(10)
            for thread in second:
                thread.join(120)
        assert not errors, errors[:3]
        assert done[0] == 400
        # Both survivors took part of the load after the loss.
        survivors = [_served(s) for s in (servers[0], servers[2])]
        assert survivors[0] > before[0] and survivors[1] > before[2]
    finally:
        for server in servers:
            server.kill()
