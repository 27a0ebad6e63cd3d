"""The gRPC edge: an unexpected failure is INTERNAL on every RPC, never UNKNOWN or a hang.

The server runs for real (127.0.0.1:0) on the small model; only the float16 look-ups of
its backend are broken, through the server's public ``loader=`` injection point, so
float16 requests hit a failure that is not a domain error while float32 ones still work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tokembed.server.backends.base import LookUp
from tokembed.server.core.dtypes import FLOAT16
from tokembed.v1 import embedding_pb2 as pb
from tokembed.v1 import embedding_pb2_grpc

from support.backends import HookedLoader
from support.requests import embed_request, reason_of, stub_for
from support.server import ServerThread

TIMEOUT_S = 10


def broken_float16(request: LookUp) -> str | None:
    """Float16 look-ups fail with an error that is no domain error; float32 ones work."""
    return "cast exploded" if request.dtype is FLOAT16 else None


@pytest.fixture
def stub(
    small_model_dir: Path, start_server: Callable[..., ServerThread]
) -> Iterator[embedding_pb2_grpc.EmbeddingServiceStub]:
    server = start_server(small_model_dir, loader=HookedLoader(fail_when=broken_float16))
    with stub_for(server.target) as stub:
        yield stub


IDS = np.array([[1, 2, 3]], dtype="<i8")


def request(output_dtype: int) -> pb.EmbedRequest:
    return embed_request(IDS, output_dtype=output_dtype)


def assert_internal(error: grpc.RpcError) -> None:
    assert error.code() == grpc.StatusCode.INTERNAL, (error.code(), error.details())
    assert "cast exploded" in error.details()
    assert reason_of(error) == "internal"


def float32_array(tensor: pb.Tensor, data: bytes | None = None) -> np.ndarray:
    assert tensor.dtype == pb.DTYPE_FLOAT32
    raw = tensor.data if data is None else data
    return np.frombuffer(raw, "<f4").reshape(list(tensor.shape))


def test_unexpected_failure_is_internal_on_embed(stub: Any, small_rows: np.ndarray) -> None:
    with pytest.raises(grpc.RpcError) as error:
        stub.Embed(request(pb.DTYPE_FLOAT16), timeout=TIMEOUT_S)
    assert_internal(error.value)
    reply = stub.Embed(request(pb.DTYPE_FLOAT32), timeout=TIMEOUT_S)
    np.testing.assert_array_equal(float32_array(reply.hidden_states), small_rows[IDS])


def test_unexpected_failure_is_internal_on_embed_chunked(stub: Any, small_rows: np.ndarray) -> None:
    with pytest.raises(grpc.RpcError) as error:
        list(stub.EmbedChunked(request(pb.DTYPE_FLOAT16), timeout=TIMEOUT_S))
    assert_internal(error.value)
    chunks = list(stub.EmbedChunked(request(pb.DTYPE_FLOAT32), timeout=TIMEOUT_S))
    data = b"".join(chunk.data for chunk in chunks[1:])
    got = float32_array(chunks[0].header.hidden_states, data)
    np.testing.assert_array_equal(got, small_rows[IDS])


def test_unexpected_failure_is_an_internal_answer_inside_embed_stream(
    stub: Any, small_rows: np.ndarray
) -> None:
    requests = [request(pb.DTYPE_FLOAT32), request(pb.DTYPE_FLOAT16), request(pb.DTYPE_FLOAT32)]
    answers = list(stub.EmbedStream(iter(requests), timeout=TIMEOUT_S))
    assert [a.WhichOneof("result") for a in answers] == ["response", "error", "response"]
    assert answers[1].error.code == grpc.StatusCode.INTERNAL.value[0]
    assert "cast exploded" in answers[1].error.message
    assert answers[1].error.reason == "internal"
    for answer in (answers[0], answers[2]):  # before the failure and after it
        got = float32_array(answer.response.hidden_states)
        np.testing.assert_array_equal(got, small_rows[IDS])
