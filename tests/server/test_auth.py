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

from tokembed.server.edge.status_codes import REASON_METADATA_KEY
from tokembed.v1 import embedding_pb2 as pb
from tokembed.v1 import embedding_pb2_grpc

from support.fixtures import SMALL_D, SMALL_PAD, SMALL_SEED, SMALL_V
from support.models import reference_rows
from support.server import ServerThread

TOKEN = "s3cret-token"
TIMEOUT_S = 10
IDS = np.array([[5, 6, 7]], dtype=np.int64)


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    return reference_rows(SMALL_V, SMALL_D, SMALL_SEED, SMALL_PAD)


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


def embed_request() -> pb.EmbedRequest:
    return pb.EmbedRequest(
        input_ids=pb.Tensor(dtype=pb.DTYPE_INT64, shape=list(IDS.shape), data=IDS.tobytes())
    )


def call_embed(stub: Any, metadata: Any) -> Any:
    return stub.Embed(embed_request(), metadata=metadata, timeout=TIMEOUT_S)


def call_info(stub: Any, metadata: Any) -> Any:
    return stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=TIMEOUT_S)


def call_stream(stub: Any, metadata: Any) -> Any:
    requests = iter([embed_request(), embed_request()])
    return list(stub.EmbedStream(requests, metadata=metadata, timeout=TIMEOUT_S))


def call_chunked(stub: Any, metadata: Any) -> Any:
    return list(stub.EmbedChunked(embed_request(), metadata=metadata, timeout=TIMEOUT_S))


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
    "other-key": (("x-token", f"Bearer {TOKEN}"),),
}
GOOD_METADATA = (("authorization", f"Bearer {TOKEN}"),)


@pytest.mark.parametrize("method", list(CALLS))
def test_missing_or_wrong_token_is_unauthenticated(
    server: ServerThread, channel: grpc.Channel, method: str
) -> None:
    stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
    for label, metadata in BAD_METADATA.items():
        with pytest.raises(grpc.RpcError) as error:
            CALLS[method](stub, metadata)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, label
        assert "bearer token" in error.value.details(), label
        assert (REASON_METADATA_KEY, "unauthenticated") in tuple(
            error.value.trailing_metadata() or ()
        ), label
    rejected = server.metric("tokembed_rejections_total", {"reason": "unauthenticated"})
    assert rejected == len(BAD_METADATA)


def test_health_check_works_without_a_token(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tokembed.v1.EmbeddingService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_right_token_works_on_every_method(
    server: ServerThread, channel: grpc.Channel, reference: np.ndarray
) -> None:
    stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
    want = reference[IDS]

    reply = call_embed(stub, GOOD_METADATA)
    got = np.frombuffer(reply.hidden_states.data, dtype="<f4").reshape(1, 3, SMALL_D)
    np.testing.assert_array_equal(got, want)

    info = call_info(stub, GOOD_METADATA)
    assert (info.name, info.vocab_size, info.d_model) == ("small", SMALL_V, SMALL_D)

    answers = call_stream(stub, GOOD_METADATA)
    assert [a.WhichOneof("result") for a in answers] == ["response", "response"]
    for answer in answers:
        data = answer.response.hidden_states.data
        np.testing.assert_array_equal(np.frombuffer(data, "<f4").reshape(want.shape), want)

    chunks = call_chunked(stub, GOOD_METADATA)
    assert chunks[0].HasField("header")
    assert list(chunks[0].header.hidden_states.shape) == [1, 3, SMALL_D]
    data = b"".join(chunk.data for chunk in chunks[1:])
    np.testing.assert_array_equal(np.frombuffer(data, "<f4").reshape(want.shape), want)

    rejected = server.metric("tokembed_rejections_total", {"reason": "unauthenticated"})
    assert rejected == 0


def test_unknown_method_is_unimplemented_not_hung(channel: grpc.Channel) -> None:
    call = channel.unary_unary("/tokembed.v1.EmbeddingService/NoSuchMethod")
    with pytest.raises(grpc.RpcError) as error:
        call(b"", metadata=GOOD_METADATA, timeout=TIMEOUT_S)
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
