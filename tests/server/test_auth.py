"""Bearer-token authentication through a real server on 127.0.0.1:0.

Every RPC of the embedding service needs ``authorization: Bearer <token>``; the health
service stays open so orchestrators can probe it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokembed.v1 import embedding_pb2 as pb
from tokembed.v1 import embedding_pb2_grpc

from support.fixtures import SMALL_D, SMALL_V
from support.requests import embed_request, reason_of
from support.server import ServerThread

TOKEN = "s3cret-token"
TIMEOUT_S = 10
IDS = np.array([[5, 6, 7]], dtype=np.int64)


@pytest.fixture
def server(
    small_model_dir: Path, start_server: Callable[..., ServerThread], tmp_path: Path
) -> ServerThread:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n", encoding="utf-8")  # surrounding whitespace is ignored
    return start_server(small_model_dir, auth_token_file=token_file)


@pytest.fixture
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.target) as channel:
        grpc.channel_ready_future(channel).result(timeout=TIMEOUT_S)
        yield channel


def call_embed(stub: Any, metadata: Any) -> Any:
    return stub.Embed(embed_request(IDS), metadata=metadata, timeout=TIMEOUT_S)


def call_info(stub: Any, metadata: Any) -> Any:
    return stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=TIMEOUT_S)


def call_stream(stub: Any, metadata: Any) -> Any:
    requests = iter([embed_request(IDS), embed_request(IDS)])
    return list(stub.EmbedStream(requests, metadata=metadata, timeout=TIMEOUT_S))


def call_chunked(stub: Any, metadata: Any) -> Any:
    return list(stub.EmbedChunked(embed_request(IDS), metadata=metadata, timeout=TIMEOUT_S))


CALLS = {
    "Embed": call_embed,
    "GetModelInfo": call_info,
    "EmbedStream": call_stream,
    "EmbedChunked": call_chunked,
}
BAD_METADATA = {
    "missing": None,
    "wrong": (("authorization", "Bearer not-the-token"),),
    "no-scheme": (("authorization", TOKEN),),
    "other-scheme": (("authorization", f"Basic {TOKEN}"),),
    "prefix": (("authorization", f"Bearer {TOKEN[:-1]}"),),
    # The real token and then more: refused whole, not compared on its first characters.
    "longer": (("authorization", f"Bearer {TOKEN}x"),),
    "trailing-space": (("authorization", f"Bearer {TOKEN} "),),
    "other-key": (("x-token", f"Bearer {TOKEN}"),),
}
GOOD_METADATA = (("authorization", f"Bearer {TOKEN}"),)


def float32_array(tensor: pb.Tensor, data: bytes | None = None) -> np.ndarray:
    assert tensor.dtype == pb.DTYPE_FLOAT32
    raw = tensor.data if data is None else data
    return np.frombuffer(raw, "<f4").reshape(list(tensor.shape))


def assert_exact(method: str, reply: Any, small_rows: np.ndarray) -> None:
    """``reply`` (what ``CALLS[method]`` returned) is exactly the small model's answer."""
    want = small_rows[IDS]
    if method == "Embed":
        np.testing.assert_array_equal(float32_array(reply.hidden_states), want)
    elif method == "GetModelInfo":
        assert (reply.name, reply.vocab_size, reply.d_model) == ("small", SMALL_V, SMALL_D)
    elif method == "EmbedStream":
        assert [a.WhichOneof("result") for a in reply] == ["response", "response"]
        for answer in reply:
            np.testing.assert_array_equal(float32_array(answer.response.hidden_states), want)
    else:
        assert method == "EmbedChunked" and reply[0].HasField("header")
        data = b"".join(chunk.data for chunk in reply[1:])
        np.testing.assert_array_equal(float32_array(reply[0].header.hidden_states, data), want)


@pytest.mark.parametrize("method", list(CALLS))
def test_missing_or_wrong_token_is_unauthenticated(
    server: ServerThread, channel: grpc.Channel, small_rows: np.ndarray, method: str
) -> None:
    stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
    for label, metadata in BAD_METADATA.items():
        with pytest.raises(grpc.RpcError) as error:
            CALLS[method](stub, metadata)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, label
        assert "bearer token" in error.value.details(), label
        assert reason_of(error.value) == "unauthenticated", label
    rejected = server.metric("tokembed_rejections_total", {"reason": "unauthenticated"})
    assert rejected == len(BAD_METADATA)
    # ... and the right token, on the same channel afterwards, gets the exact answer.
    assert_exact(method, CALLS[method](stub, GOOD_METADATA), small_rows)
    assert server.metric("tokembed_rejections_total", {"reason": "unauthenticated"}) == rejected


def test_health_check_works_without_a_token(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tokembed.v1.EmbeddingService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_right_token_works_on_every_method(
    server: ServerThread, channel: grpc.Channel, small_rows: np.ndarray
) -> None:
    stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
    for method, call in CALLS.items():
        assert_exact(method, call(stub, GOOD_METADATA), small_rows)
    rejected = server.metric("tokembed_rejections_total", {"reason": "unauthenticated"})
    assert rejected == 0


def test_unknown_method_is_unimplemented_not_hung(channel: grpc.Channel) -> None:
    call = channel.unary_unary("/tokembed.v1.EmbeddingService/NoSuchMethod")
    with pytest.raises(grpc.RpcError) as error:
        call(b"", metadata=GOOD_METADATA, timeout=TIMEOUT_S)
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
