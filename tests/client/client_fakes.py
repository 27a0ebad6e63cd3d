"""A scripted fake EmbeddingService on 127.0.0.1, for the cases a real server cannot produce.

Every behaviour a real server can show is tested against the real one (conftest.py's
``real_server`` and friends). This fake exists only for what the real server never does on
cue, and nothing else:

- a failure scripted for the n-th attempt of a call (UNAVAILABLE twice, then an answer),
  with the arrival time and the deadline left of every attempt recorded: what the tests of
  retries, backoff and the overall deadline measure the client by. The real server fails
  only by its state (loading, draining, a full queue), which cannot be switched per attempt
  nor timed to the millisecond;
- a stream of chunks broken after its n-th message (a connection lost mid-answer);
- answers that break the protocol: a wrong shape, a chunked answer cut short, more
  EmbedStream answers than requests or fewer. A correct server never sends them; the client
  must refuse them rather than return a wrong array.

It answers rectangular input (``[B, S]``, int64 or int32) with ``row(id) = id * D +
arange(D)``, so every value is checkable. It refuses ragged input (INVALID_ARGUMENT,
reason invalid_input: no remaining test needs it, and a fake that padded it otherwise than
the proto says would mislead). As the proto says, a refusal carries its reason: unary calls
in the trailing metadata ``tokembed-error-reason``, EmbedStream items in ``Error.reason``.

Tests push actions onto ``FakeService.script``; each Embed, EmbedChunked or EmbedStream call
takes the next one (GetModelInfo never does). Calls are recorded in ``FakeService.calls``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from tokembed.v1 import embedding_pb2 as pb
from tokembed.v1 import embedding_pb2_grpc as pb_grpc

D = 8
FAKE_NAME = "fake-model"
MAX_MESSAGE = 64 * 1024 * 1024
_NP = {pb.DTYPE_INT64: "<i8", pb.DTYPE_INT32: "<i4"}


def rows(ids: Any) -> np.ndarray:
    """The fake's answer for ``ids`` (any shape): ``id * D + arange(D)``, float32."""
    ids = np.asarray(ids, dtype=np.int64)
    return (ids[..., None] * D + np.arange(D)).astype(np.float32)


@dataclass
class Abort:
    """Fail the call with ``code``; ``reason`` goes to tokembed-error-reason. Streaming
    methods send ``after_messages`` messages first."""

    code: grpc.StatusCode
    reason: str | None = None
    message: str = "scripted failure"
    after_messages: int = 0


@dataclass
class Reply:
    """Answer, with the messages the call would send passed through ``edit`` first (to
    break the protocol): ``[EmbedResponse]`` for Embed, the chunks for EmbedChunked, the
    answers for EmbedStream."""

    edit: Callable[[list[Any]], list[Any]]


@dataclass
class Call:
    method: str
    at: float  # time.monotonic() when the handler began
    time_remaining: float | None  # the deadline left then, as the server saw it


@dataclass
class FakeService(pb_grpc.EmbeddingServiceServicer):
    chunk_bytes: int = 1000
    script: list[Abort | Reply] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, method: str) -> int:
        return sum(1 for c in self.calls if c.method == method)

    def _enter(self, method: str, context: grpc.ServicerContext) -> Abort | Reply | None:
        with self.lock:
            self.calls.append(Call(method, time.monotonic(), context.time_remaining()))
            return self.script.pop(0) if self.script and method != "GetModelInfo" else None

    # ---------------------------------------------------------------- RPCs
    def Embed(self, request: pb.EmbedRequest, context: grpc.ServicerContext) -> pb.EmbedResponse:
        action = self._enter("Embed", context)
        if isinstance(action, Abort):
            _abort(context, action)
        response = _answer(request, context)
        return _edit(action, [response])[0]

    def EmbedChunked(
        self, request: pb.EmbedRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.EmbedChunk]:
        action = self._enter("EmbedChunked", context)
        response = _answer(request, context)
        data = response.hidden_states.data
        response.hidden_states.data = b""
        messages = [pb.EmbedChunk(header=response)] + [
            pb.EmbedChunk(data=data[i : i + self.chunk_bytes])
            for i in range(0, len(data), self.chunk_bytes)
        ]
        yield from _send(context, action, _edit(action, messages))

    def EmbedStream(
        self, request_iterator: Iterator[pb.EmbedRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.EmbedStreamResponse]:
        action = self._enter("EmbedStream", context)
        # All requests first, then the answers: in order, one per request, as the proto
        # asks (a scripted Reply may then add or drop some).
        answers = [_stream_answer(request) for request in request_iterator]
        yield from _send(context, action, _edit(action, answers))

    def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext
    ) -> pb.ModelInfo:
        # The client asks for D before it decides on EmbedChunked, and uses nothing else.
        self._enter("GetModelInfo", context)
        return pb.ModelInfo(name=FAKE_NAME, version="1", d_model=D)


def _refusal(request: pb.EmbedRequest) -> tuple[grpc.StatusCode, str, str] | None:
    """Why the fake will not answer ``request`` (code, reason, message), or None."""
    if request.lengths:
        return (
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_input",
            "the fake answers rectangular input only",
        )
    if request.input_ids.dtype not in _NP or len(request.input_ids.shape) != 2:
        return grpc.StatusCode.INVALID_ARGUMENT, "invalid_input", "input_ids must be [B, S] ints"
    return None


def _answer(request: pb.EmbedRequest, context: grpc.ServicerContext) -> pb.EmbedResponse:
    problem = _refusal(request)
    if problem is not None:
        _abort(context, Abort(*problem))
    return _response(request)


def _response(request: pb.EmbedRequest) -> pb.EmbedResponse:
    ids = np.frombuffer(request.input_ids.data, _NP[request.input_ids.dtype])
    hs = rows(ids.reshape(tuple(request.input_ids.shape)))
    if request.output_dtype == pb.DTYPE_FLOAT16:
        hs, dtype = hs.astype(np.float16), pb.DTYPE_FLOAT16
    else:
        dtype = pb.DTYPE_FLOAT32
    return pb.EmbedResponse(
        hidden_states=pb.Tensor(dtype=dtype, shape=hs.shape, data=hs.tobytes()),
        model_name=FAKE_NAME,
        model_version="1",
        request_id=request.request_id,
    )


def _stream_answer(request: pb.EmbedRequest) -> pb.EmbedStreamResponse:
    problem = _refusal(request)
    if problem is None:
        return pb.EmbedStreamResponse(response=_response(request))
    code, reason, message = problem
    return pb.EmbedStreamResponse(
        error=pb.Error(code=code.value[0], message=message, reason=reason)
    )


def _edit(action: Abort | Reply | None, messages: list[Any]) -> list[Any]:
    return action.edit(messages) if isinstance(action, Reply) else messages


def _send(context: grpc.ServicerContext, action: Abort | Reply | None, messages: list[Any]) -> Any:
    for sent, message in enumerate(messages):
        if isinstance(action, Abort) and action.after_messages == sent:
            _abort(context, action)
        yield message
    if isinstance(action, Abort):
        _abort(context, action)


def _abort(context: grpc.ServicerContext, action: Abort) -> None:
    if action.reason is not None:
        context.set_trailing_metadata((("tokembed-error-reason", action.reason),))
    context.abort(action.code, action.message)


@dataclass
class FakeServer:
    service: FakeService
    server: grpc.Server
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(grace=None).wait(5)


def start_fake_server(service: FakeService | None = None) -> FakeServer:
    """Start a fake on 127.0.0.1, on a free port."""
    service = service or FakeService()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_EmbeddingServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port, "could not bind a loopback port"
    server.start()
    return FakeServer(service, server, port)
