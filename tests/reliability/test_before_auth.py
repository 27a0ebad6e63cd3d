"""What a caller without the token can make the server hold or tell, for real: the receive
limit follows the largest valid request (not the answer limit), a connection carries a
bounded number of streams, health refuses oversized service names before holding them,
and health names no model to a caller without the token.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from reliability_support import MiB, peak_rss, varint

from support.server import ServerProcess, ServerThread, serve_args

TOKEN = "tok-5be1-before-auth"
GOOD_METADATA = (("authorization", f"Bearer {TOKEN}"),)
SERVER_LIVE = "/inference.GRPCInferenceService/ServerLive"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
MODEL = "small"  # the small test model's name
HUGE = 50 * MiB


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def guarded(small_model_dir: Path, token_file: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        serve_args(small_model_dir, "--auth-token-file", str(token_file))
    ).start()
    try:
        yield server
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        finally:
            server.kill()


def _raw_call(target: str, method: str, raw: bytes) -> grpc.RpcError:
    options = [("grpc.max_send_message_length", -1)]
    with (
        grpc.insecure_channel(target, options=options) as channel,
        pytest.raises(grpc.RpcError) as caught,
    ):
        channel.unary_unary(method)(raw, timeout=60)
    error: grpc.RpcError = caught.value
    return error


def _health_request(service_bytes: int) -> bytes:
    return b"\x0a" + varint(service_bytes) + b"a" * service_bytes


# --- the receive limit: what an unauthenticated caller can make the server buffer


@pytest.mark.parametrize(
    ("method", "raw"),
    [(SERVER_LIVE, b"\x0a" * HUGE), (HEALTH_CHECK, _health_request(HUGE))],
    ids=["ServerLive", "health Check"],
)
def test_fifty_megabytes_without_a_token_are_refused_unbuffered(
    guarded: ServerProcess, method: str, raw: bytes
) -> None:
    assert guarded.process is not None
    pid = guarded.process.pid
    before = peak_rss(pid)
    error = _raw_call(guarded.target, method, raw)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    # Buffered whole, the 50 MB would raise the peak by at least that much.
    assert peak_rss(pid) - before < 16 * MiB, (before, peak_rss(pid))
    # ... and the server goes on answering.
    with grpc.insecure_channel(guarded.target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("method", [HEALTH_CHECK, HEALTH_WATCH])
def test_a_long_health_service_name_is_refused_by_its_size(
    guarded: ServerProcess, method: str
) -> None:
    """Under the receive limit, but far longer than any service name: refused before the
    name is kept (a Watch would hold it for as long as the stream stays open)."""
    raw = _health_request(64 * 1024)
    with grpc.insecure_channel(guarded.target) as channel:
        call = (
            channel.unary_stream(method) if method == HEALTH_WATCH else channel.unary_unary(method)
        )
        with pytest.raises(grpc.RpcError) as caught:
            reply = call(raw, timeout=10)
            if method == HEALTH_WATCH:
                next(iter(reply))
    error = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert f"health request of {len(raw)} bytes" in (error.details() or ""), error.details()


# --- streams per connection


def test_streams_on_one_connection_are_capped(
    small_model_dir: Path, start_server: Callable[..., ServerThread]
) -> None:
    """Watch streams never end by themselves: a connection may hold only
    max_concurrent_streams of them; the next waits until one closes."""
    server = start_server(small_model_dir, max_concurrent_streams=8)

    async def run() -> tuple[int, int]:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            calls = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(12)]
            reads = [asyncio.ensure_future(call.read()) for call in calls]
            # Long enough for every stream the server takes to be answered.
            await asyncio.wait(reads, timeout=5)
            answered = sum(read.done() for read in reads)
            # One stream closed: one of the waiting ones is answered.
            next(call for call, read in zip(calls, reads, strict=True) if read.done()).cancel()
            await asyncio.wait([read for read in reads if not read.done()], timeout=10,
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            after = sum(read.done() and not read.cancelled() for read in reads)
            for call in calls:
                call.cancel()
            return answered, after

    answered, after = asyncio.run(run())
    assert answered == 8
    assert after >= 9


# --- what health tells without the token


def _check(channel: grpc.Channel, service: str, metadata: object = None) -> object:
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = stub.Check(
            health_pb2.HealthCheckRequest(service=service), metadata=metadata, timeout=10
        )
    except grpc.RpcError as error:
        return (error.code(), error.details())
    return reply.status


def _first_watched(channel: grpc.Channel, service: str, metadata: object = None) -> object:
    stub = health_pb2_grpc.HealthStub(channel)
    call = stub.Watch(health_pb2.HealthCheckRequest(service=service), metadata=metadata, timeout=10)
    try:
        return next(iter(call)).status
    finally:
        call.cancel()


def test_health_names_no_model_without_the_token(guarded: ServerProcess) -> None:
    with grpc.insecure_channel(guarded.target) as channel:
        # Without the token a model's name is answered as a name that does not exist.
        assert _check(channel, MODEL) == _check(channel, "no-such-model")
        assert _check(channel, MODEL)[0] == grpc.StatusCode.NOT_FOUND  # type: ignore[index]
        assert _first_watched(channel, MODEL) == _first_watched(channel, "no-such-model")
        assert _first_watched(channel, MODEL) == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        wrong = (("authorization", f"Bearer {TOKEN}x"),)
        assert _check(channel, MODEL, wrong) == _check(channel, "no-such-model", wrong)
        # The overall status and the protocol's service stay open to probes.
        serving = health_pb2.HealthCheckResponse.SERVING
        assert _check(channel, "") == serving
        assert _check(channel, "tokembed.v1.EmbeddingService") == serving
        assert _first_watched(channel, "") == serving
        # With the token, a model's own health.
        assert _check(channel, MODEL, GOOD_METADATA) == serving
        assert _first_watched(channel, MODEL, GOOD_METADATA) == serving
        missing = _check(channel, "no-such-model", GOOD_METADATA)
        assert missing[0] == grpc.StatusCode.NOT_FOUND  # type: ignore[index]
