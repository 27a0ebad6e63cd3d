"""A scripted fake EmbeddingService on 127.0.0.1, for the client's tests.

The fake stands in for the real server only because the real one (server/) is being
written at the same time; end-to-end tests against the real server live in tests/e2e/.
It implements the protocol as the proto documents it (unary, stream, chunked, model
info, ListModels, ragged layouts, float16, several models chosen by ``model_name``) with
a table that makes every value checkable: E[id]*scale is replaced by
``row(id) = id * D + arange(D)`` (distinct for every id, and D differs between models).

Each test scripts failures by pushing actions onto ``FakeService.script``; every call is
recorded (method, request, metadata, arrival time, deadline left) in ``FakeService.calls``.
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
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tokembed.v1 import embedding_pb2 as pb
from tokembed.v1 import embedding_pb2_grpc as pb_grpc

D = 8
FAKE_NAME = "fake-model"
FAKE_VERSION = "7"
MAX_MESSAGE = 64 * 1024 * 1024
_NP = {pb.DTYPE_INT64: "<i8", pb.DTYPE_INT32: "<i4"}


def rows(ids: Any, d: int = D, dtype: Any = np.float32) -> np.ndarray:
    """The fake table's rows for ``ids`` (any shape): ``id * D + arange(D)``."""
    ids = np.asarray(ids, dtype=np.int64)
    return (ids[..., None] * d + np.arange(d)).astype(dtype)


@dataclass
class Abort:
    """Fail the call with ``code``; ``reason`` goes to tokembed-error-reason."""

    code: grpc.StatusCode
    reason: str | None = None
    message: str = "scripted failure"
    delay_s: float = 0.0
    after_chunks: int = 0  # EmbedChunked: send this many messages first


@dataclass
class Delay:
    """Sleep before answering normally."""

    seconds: float


@dataclass
class Call:
    method: str
    request: Any
    metadata: dict[str, str]
    at: float
    time_remaining: float | None
    peer: str


@dataclass
class FakeService(pb_grpc.EmbeddingServiceServicer):
    d_model: int = D  # the default model's (FAKE_NAME's)
    # Models served beside the default one, name -> D; requests name them in model_name.
    more_models: dict[str, int] = field(default_factory=dict)
    chunk_bytes: int = 1000
    required_token: str | None = None
    script: list[Any] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    # Hook to corrupt answers: EmbedResponse -> EmbedResponse
    mutate: Callable[[pb.EmbedResponse], pb.EmbedResponse] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    # ---------------------------------------------------------------- helpers
    def count(self, method: str) -> int:
        return sum(1 for c in self.calls if c.method == method)

    def served(self) -> dict[str, int]:
        """Every model served, name -> D, the default first."""
        return {FAKE_NAME: self.d_model, **self.more_models}

    def resolve(self, name: str) -> tuple[str, int] | Abort:
        """The model a request names ("": the default) and its D, or the NOT_FOUND."""
        served = self.served()
        name = name or FAKE_NAME
        if name not in served:
            return Abort(
                grpc.StatusCode.NOT_FOUND,
                "not_found",
                f"model {name!r} is not served here (this server serves {sorted(served)})",
            )
        return name, served[name]

    def _enter(self, method: str, request: Any, context: grpc.ServicerContext) -> Any:
        metadata = {k: v for k, v in context.invocation_metadata()}
        with self.lock:
            self.calls.append(
                Call(
                    method,
                    request,
                    metadata,
                    time.monotonic(),
                    context.time_remaining(),
                    context.peer(),
                )
            )
            action = self.script.pop(0) if self.script and method != "GetModelInfo" else None
        if self.required_token is not None and (
            metadata.get("authorization") != f"Bearer {self.required_token}"
        ):
            _abort(context, Abort(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", "bad token"))
        return action

    def answer(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        model = self.resolve(request.model_name)
        assert not isinstance(model, Abort), "checked before answering"
        name, d = model
        ids = np.frombuffer(request.input_ids.data, _NP[request.input_ids.dtype])
        out_dtype = np.float16 if request.output_dtype == pb.DTYPE_FLOAT16 else np.float32
        lengths = list(request.lengths)
        if not lengths:
            hs = rows(ids.reshape(tuple(request.input_ids.shape)), d, out_dtype)
        elif request.ragged_layout == pb.RAGGED_LAYOUT_FLAT:
            hs = rows(ids, d, out_dtype)
        else:
            hs = np.zeros((len(lengths), max(lengths), d), out_dtype)
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            for b, (s, n) in enumerate(zip(starts, lengths, strict=True)):
                hs[b, :n] = rows(ids[s : s + n], d, out_dtype)
        response = pb.EmbedResponse(
            hidden_states=pb.Tensor(
                dtype=pb.DTYPE_FLOAT16 if out_dtype == np.float16 else pb.DTYPE_FLOAT32,
                shape=hs.shape,
                data=hs.tobytes(),
            ),
            lengths=lengths,
            timings=pb.Timings(
                queue_seconds=0.001,
                compute_seconds=0.002,
                server_seconds=0.004,
                batch_requests=1,
                batch_tokens=ids.size,
            ),
            model_name=name,
            model_version=FAKE_VERSION,
            request_id=request.request_id,
        )
        return self.mutate(response) if self.mutate else response

    def _check(self, request: pb.EmbedRequest) -> Abort | None:
        model = self.resolve(request.model_name)
        if isinstance(model, Abort):
            return model
        ids = np.frombuffer(request.input_ids.data, _NP[request.input_ids.dtype])
        if ids.size and ids.min() < 0:
            return Abort(grpc.StatusCode.INVALID_ARGUMENT, "invalid_input", "negative id")
        return None

    # ---------------------------------------------------------------- RPCs
    def Embed(self, request: pb.EmbedRequest, context: grpc.ServicerContext) -> pb.EmbedResponse:
        action = self._enter("Embed", request, context)
        _act(context, action)
        problem = self._check(request)
        if problem:
            _abort(context, problem)
        return self.answer(request)

    def EmbedChunked(
        self, request: pb.EmbedRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.EmbedChunk]:
        action = self._enter("EmbedChunked", request, context)
        if not (isinstance(action, Abort) and action.after_chunks):
            _act(context, action)
        problem = self._check(request)
        if problem:
            _abort(context, problem)
        response = self.answer(request)
        data = response.hidden_states.data
        header = pb.EmbedResponse()
        header.CopyFrom(response)
        header.hidden_states.data = b""
        messages = [pb.EmbedChunk(header=header)] + [
            pb.EmbedChunk(data=data[i : i + self.chunk_bytes])
            for i in range(0, len(data), self.chunk_bytes)
        ]
        for n, message in enumerate(messages):
            if isinstance(action, Abort) and action.after_chunks == n:
                _abort(context, action)
            yield message

    def EmbedStream(
        self, request_iterator: Iterator[pb.EmbedRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.EmbedStreamResponse]:
        self._enter("EmbedStream", None, context)
        for request in request_iterator:
            with self.lock:
                self.calls.append(Call("EmbedStream.item", request, {}, time.monotonic(), None, ""))
            problem = self._check(request)
            if problem:
                yield pb.EmbedStreamResponse(
                    error=pb.Error(code=problem.code.value[0], message=problem.message)
                )
            else:
                yield pb.EmbedStreamResponse(response=self.answer(request))

    def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext
    ) -> pb.ModelInfo:
        self._enter("GetModelInfo", request, context)
        model = self.resolve(request.model_name)
        if isinstance(model, Abort):
            _abort(context, model)
        assert not isinstance(model, Abort)
        return self.model_info(*model)

    def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.ServicerContext
    ) -> pb.ListModelsResponse:
        _act(context, self._enter("ListModels", request, context))
        return pb.ListModelsResponse(
            models=[self.model_info(name, d) for name, d in self.served().items()],
            default_model=FAKE_NAME,
        )

    def model_info(self, name: str, d_model: int) -> pb.ModelInfo:
        return pb.ModelInfo(
            name=name,
            version=FAKE_VERSION,
            vocab_size=32000,
            d_model=d_model,
            scale=1.0,
            padding_id=0,
            weight_dtype="float32",
            input_dtypes=[pb.DTYPE_INT64, pb.DTYPE_INT32],
            output_dtypes=[pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16],
            execution_provider="FakeExecutionProvider",
            limits=pb.Limits(
                max_tokens_per_request=4096,
                max_output_bytes_per_request=MAX_MESSAGE,
                max_batch_tokens=8192,
                max_message_bytes=MAX_MESSAGE,
                max_delay_seconds=0.002,
            ),
            model_sha256="ab" * 32,
            backend="table" if name == FAKE_NAME else "onnxruntime",
        )


def _abort(context: grpc.ServicerContext, action: Abort) -> None:
    if action.reason is not None:
        context.set_trailing_metadata((("tokembed-error-reason", action.reason),))
    context.abort(action.code, action.message)


def _act(context: grpc.ServicerContext, action: Any) -> None:
    if isinstance(action, Delay):
        time.sleep(action.seconds)
    elif isinstance(action, Abort):
        time.sleep(action.delay_s)
        _abort(context, action)


@dataclass
class FakeServer:
    service: FakeService
    health: health.HealthServicer
    server: grpc.Server
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(grace=None).wait(5)


def start_fake_server(
    service: FakeService | None = None,
    *,
    credentials: grpc.ServerCredentials | None = None,
) -> FakeServer:
    """Start a fake on 127.0.0.1, a free port; health reports SERVING."""
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
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("tokembed.v1.EmbeddingService", health_pb2.HealthCheckResponse.SERVING)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    assert port, "could not bind a loopback port"
    server.start()
    return FakeServer(service, health_servicer, server, port)


def free_port() -> int:
    """A loopback port with nothing listening (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_certificates(directory: Any) -> dict[str, Any]:
    """A throw-away CA, a server certificate for localhost/127.0.0.1 and a client
    certificate, made with the openssl command (EC keys: fast)."""
    import shutil
    import subprocess
    from pathlib import Path

    openssl = shutil.which("openssl")
    if openssl is None:
        import pytest

        pytest.skip("the openssl command is needed to make test certificates")
    d = Path(directory)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=d, timeout=60)

    run("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=tokembed-test-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    for name, ext in (
        ("server", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (d / f"{name}.ext").write_text(ext)
        run("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
            "-extfile", f"{name}.ext")  # fmt: skip
    return {
        "ca": d / "ca.pem",
        "server_cert": d / "server.pem",
        "server_key": d / "server.key",
        "client_cert": d / "client.pem",
        "client_key": d / "client.key",
    }
