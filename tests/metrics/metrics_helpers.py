"""Helpers of the metrics tests: requests through the plain generated stubs.

The tests talk to the server with the raw stubs any gRPC client has, so what they count
is what arrives on the wire, independent of our client library.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import numpy as np

from tokembed.v1 import embedding_pb2 as pb
from tokembed.v1 import embedding_pb2_grpc

STEP_S = 0.01


def embed_request(ids: Any, *, dtype: str = "int64", **fields: Any) -> pb.EmbedRequest:
    """An EmbedRequest for ``ids`` [B,S] (or [N] with ``lengths=``), int64 unless asked."""
    array = np.asarray(ids, dtype=dtype)
    proto_dtype = pb.DTYPE_INT64 if dtype == "int64" else pb.DTYPE_INT32
    return pb.EmbedRequest(
        input_ids=pb.Tensor(dtype=proto_dtype, shape=list(array.shape), data=array.tobytes()),
        **fields,
    )


def ids_of(n_tokens: int, start: int = 1, batch: int = 1) -> np.ndarray:
    """Valid ids (V is 1000 in the small model) shaped [batch, n_tokens]."""
    return (np.arange(batch * n_tokens, dtype=np.int64) + start).reshape(batch, n_tokens) % 1000


@contextmanager
def stub_for(target: str) -> Iterator[embedding_pb2_grpc.EmbeddingServiceStub]:
    with grpc.insecure_channel(target) as channel:
        yield embedding_pb2_grpc.EmbeddingServiceStub(channel)


def error_reason(error: grpc.RpcError) -> str:
    """The server's ``tokembed-error-reason`` trailer (why, beyond the status code)."""
    call: Any = error
    for key, value in call.trailing_metadata() or ():
        if key == "tokembed-error-reason":
            return str(value)
    return ""
