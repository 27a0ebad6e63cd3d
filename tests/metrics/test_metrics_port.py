"""The metrics port of a real ``tokembed serve``: /metrics alone (other paths are 404, so
that an HTTP probe aimed at it cannot pass by mistake), and idle connections neither pile
up threads nor stop a scrape; the server closes them."""

from __future__ import annotations

import contextlib
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokembed.server.observability.metrics_http import (
    METRICS_MAX_CONNECTIONS,
    METRICS_READ_TIMEOUT_S,
)

from support.metrics import scrape, value
from support.server import ServerProcess, serve_args

IDLE_CONNECTIONS = 200


@pytest.fixture(scope="module")
def server(small_model_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(serve_args(small_model_dir)).start()
    try:
        yield server
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        finally:
            server.kill()


def _threads(server: ServerProcess) -> int:
    assert server.process is not None
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads: line")


def _status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.parametrize("path", ["/healthz", "/v2/health/ready", "/", "/metricsx"])
def test_only_metrics_is_served(server: ServerProcess, path: str) -> None:
    assert _status(server.metrics_port, path) == 404
    assert _status(server.metrics_port, "/metrics") == 200


def test_idle_connections_are_bounded_and_do_not_stop_a_scrape(server: ServerProcess) -> None:
    threads_before = _threads(server)
    idle: list[socket.socket] = []
    try:
        for _ in range(IDLE_CONNECTIONS):
            idle.append(socket.create_connection(("127.0.0.1", server.metrics_port), timeout=10))
        time.sleep(0.5)  # for the server to take them in
        # At most one thread per connection it keeps, and it keeps a bounded number.
        assert _threads(server) - threads_before <= METRICS_MAX_CONNECTIONS + 2
        started = time.monotonic()
        text = scrape(server.metrics_port, timeout_s=10)
        assert time.monotonic() - started < 1.0
        assert value(text, "tokembed_ready") == 1
        # Every idle connection is closed by the server: the oldest to make room for
        # newer ones, the rest once the read timeout passes.
        deadline = time.monotonic() + METRICS_READ_TIMEOUT_S + 15
        for sock in idle:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1) == b""
    finally:
        for sock in idle:
            sock.close()
