"""End to end: start-up, health, draining on SIGTERM, refusing bad model directories."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokembed.client import EmbeddingClient, UnavailableError
from tokembed.v1 import embedding_pb2 as pb
from tokembed.v1 import embedding_pb2_grpc

from support.backends import HOLDABLE, HookedLoader
from support.fixtures import DEFAULT_V, SMALL_D, SMALL_V
from support.metrics import scrape, total
from support.no_torch import env_without_torch
from support.requests import embed_request
from support.server import ServerProcess, serve_args, wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status)


def test_health_walks_not_serving_serving_not_serving_while_draining(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray
) -> None:
    loader = HookedLoader(open_loading=False)
    server = start_server(
        small_model_dir,
        loader=loader,
        wait_ready=False,
        **HOLDABLE,
    )
    assert _health(server.target) == NOT_SERVING  # bound, model still loading
    with EmbeddingClient(server.target, retries=0) as client, pytest.raises(UnavailableError):
        client.embed([[1]])
    loader.loading_gate.open()
    assert wait_for(lambda: _health(server.target) == SERVING, 30)

    # Hold one request in flight, then drain: health turns NOT_SERVING at once, new
    # requests get UNAVAILABLE, and the held request still completes.
    loader.look_up_gate.close()
    results: list[Any] = []
    with EmbeddingClient(server.target, retries=0) as client:
        held = threading.Thread(target=lambda: results.append(client.embed([[3, 4]])))
        held.start()
        assert loader.backend is not None and loader.backend.entered.wait(10)
        stopping = server.submit(server.server.stop(10))
        assert wait_for(lambda: _health(server.target) == NOT_SERVING, 5)
        with pytest.raises(UnavailableError):
            client.embed([[5]])
        loader.look_up_gate.open()
        held.join(10)
        stopping.result(15)
    assert len(results) == 1
    np.testing.assert_array_equal(results[0], small_rows[[[3, 4]]])


def test_sigterm_with_requests_in_flight_completes_them_and_exits_0(
    default_model_dir: Path, default_rows: np.ndarray
) -> None:
    server = ServerProcess(serve_args(default_model_dir, "--grace-s", "20")).start()
    try:
        ids = (np.arange(32 * 512) % DEFAULT_V).reshape(32, 512)  # ~34 MB answers: slow
        want = default_rows[ids]
        results: list[Any] = []
        errors: list[BaseException] = []

        def call() -> None:
            try:
                with EmbeddingClient(server.target, retries=0, timeout_s=60) as client:
                    results.append(client.embed(ids))
            except BaseException as exc:
                errors.append(exc)

        request = embed_request(ids)
        with grpc.insecure_channel(server.target) as channel:
            # One call held in flight until the signal has landed: an EmbedChunked answer
            # read only afterwards. Flow control stops the server sending once this
            # reader's window and socket buffers are full (2-4 MB here, against 34 MB), so
            # the call cannot end before it is read, however fast the other six go.
            held = embedding_pb2_grpc.EmbeddingServiceStub(channel).EmbedChunked(
                request, timeout=60
            )
            header = next(held).header.hidden_states  # its handler is answering
            threads = [threading.Thread(target=call) for _ in range(6)]
            for thread in threads:
                thread.start()
            # Wait until the server has accepted all seven (in flight or done), then stop
            # it. Two scrapes in a row: one that lands as a call ends, between its OK being
            # counted and its in-flight count dropping, counts that call twice.
            assert wait_for(lambda: _accepted(server) >= 7 and _accepted(server) >= 7, 30)
            assert _inflight(server) >= 1  # the held call, at least, until it is read
            server.send_signal(signal.SIGTERM)
            data = b"".join(chunk.data for chunk in held)
        for thread in threads:
            thread.join(60)
        assert server.wait(30) == 0
        assert not errors, errors
        assert len(results) == 6
        for got in results:
            np.testing.assert_array_equal(got, want)
        assert header.dtype == pb.DTYPE_FLOAT32
        np.testing.assert_array_equal(np.frombuffer(data, "<f4").reshape(list(header.shape)), want)
        assert "signal received: draining" in server.output
    finally:
        server.kill()


def _inflight(server: ServerProcess) -> float:
    return total(scrape(server.metrics_port, timeout_s=5), "tokembed_inflight_requests")


def _accepted(server: ServerProcess) -> float:
    """Embeds answered or in flight (the client sends answers this large as EmbedChunked),
    read from one scrape."""
    text = scrape(server.metrics_port, timeout_s=5)
    done = sum(
        total(text, "tokembed_requests_total", {"method": method, "code": "OK"})
        for method in ("Embed", "EmbedChunked")
    )
    return done + total(text, "tokembed_inflight_requests")


def test_serve_refuses_an_invalid_model_directory(small_model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(small_model_dir, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["d_model"] = SMALL_D + 1
    (broken / "manifest.json").write_text(json.dumps(manifest))
    result = subprocess.run(
        [sys.executable, "-m", "tokembed.cli", "serve", *serve_args(broken)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "invalid model directory" in result.stderr
    assert "d_model" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_without_a_model_creates_the_default_one_without_torch(
    tmp_path: Path, default_rows: np.ndarray
) -> None:
    """The main job needs only the server's install: here `import torch` fails in the
    server process and in any process it starts."""
    default_dir = tmp_path / "models" / "default"
    server = ServerProcess(
        ["--port", "0", "--metrics-port", "-1", "--default-model-dir", str(default_dir)],
        env=env_without_torch(tmp_path / "no-torch"),
    )
    try:
        server.start(timeout_s=180)
        with EmbeddingClient(server.target) as client:
            hidden = client.embed([[5, 6, 7, 8, 9, 10, 11, 12]])
            info = client.model_info()
        np.testing.assert_array_equal(hidden[0], default_rows[5:13])
        assert (info.name, info.vocab_size, info.d_model) == ("tokembed-default", 32000, 512)
        assert (default_dir / "manifest.json").is_file()
        assert "building the built-in default model" in server.output
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(30) == 0
    # A second start finds the model and serves it as it is.
    data = default_dir / "model.onnx.data"
    built = data.stat().st_mtime_ns
    again = ServerProcess(
        ["--port", "0", "--metrics-port", "-1", "--default-model-dir", str(default_dir)],
        env=env_without_torch(tmp_path / "no-torch"),
    )
    try:
        again.start(timeout_s=180)
        assert "building" not in again.output
    finally:
        again.send_signal(signal.SIGINT)
        assert again.wait(30) == 0
    assert data.stat().st_mtime_ns == built


def test_serve_refuses_a_default_model_dir_holding_other_files(tmp_path: Path) -> None:
    default_dir = tmp_path / "default"
    default_dir.mkdir()
    (default_dir / "notes.txt").write_text("mine")
    result = subprocess.run(
        [sys.executable, "-m", "tokembed.cli", "serve", "--port", "0", "--metrics-port", "-1",
         "--default-model-dir", str(default_dir)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("tokembed serve: error: cannot create the default model: "), lines
    assert "not empty, but holds no manifest.json" in lines[-1]
    assert "Traceback" not in result.stderr
    assert [p.name for p in default_dir.iterdir()] == ["notes.txt"]


def test_serve_help_documents_every_setting_and_its_variable() -> None:
    from dataclasses import fields

    from tokembed.server.process.settings import Settings

    result = subprocess.run(
        [sys.executable, "-m", "tokembed.cli", "serve", "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for spec in fields(Settings):
        assert "--" + spec.name.replace("_", "-") in text
        assert "TOKEMBED_" + spec.name.upper() in text


def test_environment_variables_configure_the_server(small_model_dir: Path) -> None:
    server = ServerProcess(
        ["--port", "0", "--metrics-port", "-1"],
        env={"TOKEMBED_MODEL_DIR": str(small_model_dir), "TOKEMBED_MAX_BATCH_TOKENS": "4321"},
    ).start()
    try:
        with EmbeddingClient(server.target) as client:
            assert client.model_info().limits.max_batch_tokens == 4321
    finally:
        server.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert server.wait(30) == 0
        assert time.monotonic() - started < 15


def _connections_to(port: int) -> set[int]:
    """The local ports of this process's open TCP sockets to 127.0.0.1:``port`` (the
    kernel's tables, /proc/net/tcp and tcp6: gRPC's sockets are IPv6 ones, holding IPv4 as
    ::ffff:127.0.0.1): one per connection this process's client has open to it. Only
    this process's (by the sockets' inodes): the port may be one an earlier server had,
    whose clients' closed sockets may still be listed (TIME_WAIT, inode 0)."""
    mine = _socket_inodes()
    ports = set()
    for table_path, family, address in (
        ("/proc/net/tcp", socket.AF_INET, "127.0.0.1"),
        ("/proc/net/tcp6", socket.AF_INET6, "::ffff:127.0.0.1"),
    ):
        if not Path(table_path).exists():
            continue  # no IPv6 here: every socket is in /proc/net/tcp
        packed = socket.inet_pton(family, address)
        # Listed as 32-bit words in the machine's byte order, each as 8 hex digits.
        words = struct.unpack(f"={len(packed) // 4}I", packed)
        wanted = "".join(f"{word:08X}" for word in words) + f":{port:04X}"
        with open(table_path, encoding="ascii") as table:
            next(table)  # the column names
            for line in table:
                fields = line.split()
                local, remote, inode = fields[1], fields[2], fields[9]
                if remote == wanted and inode in mine:
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def _socket_inodes() -> set[str]:
    """The inodes of this process's open sockets (its descriptors' ``socket:[N]`` links)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):  # closed since it was listed
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    return inodes


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("max_age_s", [0.5, 0.0], ids=["max-age", "no-max-age"])
def test_max_connection_age_recycles_connections_without_failing_calls(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray, max_age_s: float
) -> None:
    """With --max-connection-age-s the server closes each connection (GOAWAY) after that
    age; the client opens another and no call fails, even without the client's retries.
    Without it, one connection carries every call. The connections are counted from the
    kernel's tables of TCP sockets, read after every call."""
    server = start_server(small_model_dir, max_connection_age_s=max_age_s, grace_s=2)
    connections: set[int] = set()
    calls = 0
    started = time.monotonic()
    with EmbeddingClient(server.target, retries=0) as client:
        while True:
            ids = [[calls % SMALL_V, (7 * calls + 3) % SMALL_V]]
            np.testing.assert_array_equal(client.embed(ids), small_rows[ids])
            calls += 1
            connections |= _connections_to(server.port)
            elapsed = time.monotonic() - started
            if max_age_s and len(connections) >= 3:
                break  # three connections: two recycled
            if not max_age_s and elapsed > 2.0:
                break  # four of the other case's ages
            # 60 s: far past three ages (0.5 s each, +-10% jitter, and a reconnection).
            assert elapsed < 60, (calls, connections)
            time.sleep(0.01)
    if max_age_s:
        assert len(connections) >= 3 and calls >= 3
    else:
        assert len(connections) == 1, connections
        assert calls > 20
