"""Helpers of the metrics tests: requests through the plain generated stubs, and a valve that
holds the backend's look-ups so a test can fill the queue behind a batch.

The tests talk to the server with the raw stubs any gRPC client has, so what they count
is what arrives on the wire, independent of our client library.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from tokembed.server.backends.base import Backend, LookUp, Rows
from tokembed.server.core.dtypes import DType
from tokembed.server.loading import LoadedModel, ModelLoader, load_model
from tokembed.server.settings import Settings
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


class Valve:
    """Holds every look-up of the runtime while closed.

    ``close()``, then send a request: its batch starts computing and stops inside the
    runtime (``held`` is set), so whatever is sent next waits in the batcher's queue,
    deterministically, until ``open()``.
    """

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self.held = threading.Event()

    def close(self) -> None:
        self.held.clear()
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def pass_through(self) -> None:
        if not self._open.is_set():
            self.held.set()
            if not self._open.wait(30):
                raise RuntimeError("the valve was left closed for 30 s")


class ValvedBackend(Backend):
    """The real backend with a valve in front of its look-ups."""

    def __init__(self, inner: Backend, valve: Valve) -> None:
        self._inner = inner
        self._valve = valve
        self.kind = inner.kind
        self.execution_provider = inner.execution_provider
        self.d_model = inner.d_model
        self.batches = inner.batches

    def look_up(self, request: LookUp) -> Rows:
        self._valve.pass_through()
        return self._inner.look_up(request)

    def look_up_batch(self, requests: Sequence[LookUp]) -> list[Rows]:
        self._valve.pass_through()
        return self._inner.look_up_batch(requests)

    def pad_row(self, dtype: DType) -> bytes:
        return self._inner.pad_row(dtype)


def valved_loader(valve: Valve) -> ModelLoader:
    """``load_model`` (validate, choose the backend, load), then the valve in front of it."""

    def load(directory: Path, settings: Settings) -> LoadedModel:
        loaded = load_model(directory, settings)
        return dataclasses.replace(loaded, backend=ValvedBackend(loaded.backend, valve))

    return load


# Settings for a server whose batches go through the valve: the onnxruntime backend, which
# batches (so requests queue behind a held batch), and every look-up off the event loop
# (a look-up inline on the loop, as small ones are by default, would hold the loop itself
# while the valve is closed).
VALVED = {"inline_compute_max_tokens": 0, "float32_table_max_bytes": 0}
