"""The client's answers to three newcomer complaints: a CANCELLED the server sent (a drain's
race inside gRPC) is retried like UNAVAILABLE, one the caller caused never is; ids that do
not fit int64 are named; a bearer token over plaintext is warned about once, and never on
loopback.

The CANCELLED cases need a server that answers CANCELLED on cue, which the real one does
only by a race (about one call in 15,000 at SIGTERM under load): a bare gRPC server here
scripts it, and answers the retry with a real EmbedResponse.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest

from tokembed.client import (
    AsyncEmbeddingClient,
    EmbeddingClient,
    InvalidInputError,
    RequestCancelledError,
)
from tokembed.v1 import embedding_pb2 as pb

D = 4


class Scripted:
    """Embed on a bare gRPC server: the first ``cancel_first`` calls get CANCELLED, the
    others ids * 1.0 as [B,S,D] rows (row = id repeated); ``hold`` keeps a call waiting."""

    def __init__(self, cancel_first: int = 0) -> None:
        self.cancel_first = cancel_first
        self.calls = 0
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()

    def embed(self, request: pb.EmbedRequest, context: grpc.ServicerContext) -> pb.EmbedResponse:
        self.calls += 1
        self.entered.set()
        if not self.hold.wait(10):
            context.abort(grpc.StatusCode.INTERNAL, "held too long")
        if self.calls <= self.cancel_first:
            context.abort(grpc.StatusCode.CANCELLED, "cancelled by the server")
        ids = np.frombuffer(request.input_ids.data, dtype="<i8").reshape(request.input_ids.shape)
        rows = np.repeat(ids[..., None], D, axis=-1).astype("<f4")
        return pb.EmbedResponse(
            hidden_states=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=rows.shape, data=rows.tobytes())
        )


@pytest.fixture
def scripted() -> Iterator[tuple[Scripted, str]]:
    service = Scripted()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    handler = grpc.method_handlers_generic_handler(
        "tokembed.v1.EmbeddingService",
        {
            "Embed": grpc.unary_unary_rpc_method_handler(
                service.embed, pb.EmbedRequest.FromString, pb.EmbedResponse.SerializeToString
            )
        },
    )
    server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield service, f"127.0.0.1:{port}"
    service.hold.set()
    server.stop(0)


def _client(target: str) -> EmbeddingClient:
    return EmbeddingClient(target, backoff_s=0.01, chunked_threshold_bytes=None, timeout_s=20)


def test_a_cancelled_sent_by_the_server_is_retried(scripted: tuple[Scripted, str]) -> None:
    service, target = scripted
    service.cancel_first = 2
    with _client(target) as client:
        hidden = client.embed([[7, 8]])
    assert service.calls == 3
    np.testing.assert_array_equal(hidden, np.repeat([[[7.0], [8.0]]], D, axis=-1))


def test_the_asyncio_client_retries_it_too(scripted: tuple[Scripted, str]) -> None:
    service, target = scripted
    service.cancel_first = 1

    async def call() -> np.ndarray:
        async with AsyncEmbeddingClient(
            target, backoff_s=0.01, chunked_threshold_bytes=None
        ) as client:
            return await client.embed([[3]])

    np.testing.assert_array_equal(asyncio.run(call()), np.full((1, 1, D), 3.0))
    assert service.calls == 2


def test_a_call_the_caller_cancels_is_not_retried(scripted: tuple[Scripted, str]) -> None:
    service, target = scripted
    service.hold.clear()

    async def call() -> None:
        async with AsyncEmbeddingClient(target, chunked_threshold_bytes=None) as client:
            task = asyncio.ensure_future(client.embed([[3]]))
            await asyncio.get_running_loop().run_in_executor(None, service.entered.wait, 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(call())
    service.hold.set()
    assert service.calls == 1


def test_a_call_cut_by_closing_the_client_is_not_retried(
    scripted: tuple[Scripted, str],
) -> None:
    service, target = scripted
    service.hold.clear()
    client = _client(target)
    closer = threading.Thread(target=lambda: (service.entered.wait(10), client.close()))
    closer.start()
    with pytest.raises(RequestCancelledError) as caught:
        client.embed([[3]])
    closer.join(10)
    service.hold.set()
    assert service.calls == 1 and caught.value.attempts == 1


@pytest.mark.parametrize(
    ("ids", "named"),
    [
        ([[1, 2**70, 3]], "sequence 0: element 1 = 1180591620717411303424 does not fit in int64"),
        ([[1, 2**63, 3]], "sequence 0: element 1 = 9223372036854775808 does not fit in int64"),
        ([5, -(2**63) - 1], "ids: element 1 = -9223372036854775809 does not fit in int64"),
        ([[1, "a"]], "sequence 0: element 1 = 'a' is not an id"),
        (np.array([[1, 2**64]], dtype=object), "ids: element (0, 1) = 18446744073709551616"),
    ],
)
def test_ids_that_are_no_int64_are_named(ids: object, named: str) -> None:
    with EmbeddingClient("127.0.0.1:1") as client, pytest.raises(InvalidInputError) as caught:
        client.embed(ids)
    assert named in str(caught.value)


def test_a_plaintext_token_is_warned_about_once_and_never_on_loopback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="tokembed.client")
    for target in ("127.0.0.1:1", "localhost:1", "[::1]:1", "ipv4:127.0.0.1:1,127.0.0.2:1"):
        EmbeddingClient(target, token="t").close()
    assert [r.getMessage() for r in caplog.records] == []
    for _ in range(3):
        EmbeddingClient("10.9.8.7:1", token="t").close()
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["sending a bearer token over a plaintext channel to 10.9.8.7:1"]
