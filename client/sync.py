"""The blocking client: ``EmbeddingClient``.

    with EmbeddingClient("127.0.0.1:50051") as client:
        hidden = client.embed([[5, 6, 7, 8, 9, 10, 11, 12]])   # [1, 8, D] float32

Thread-safe: one client (one channel, HTTP/2-multiplexed) can serve many threads.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, TypeVar, overload

import grpc
import numpy as np
import numpy.typing as npt

from tokembed.client import codec, decode
from tokembed.client._config import (
    METHOD_EMBED,
    METHOD_EMBED_CHUNKED,
    METHOD_EMBED_STREAM,
    METHOD_GET_MODEL_INFO,
    ClientBase,
    Deadline,
    give_up,
)
from tokembed.client.errors import EmbeddingError, from_rpc_error, protocol_error
from tokembed.client.results import EmbedResult, ModelInfo
from tokembed.v1 import embedding_pb2 as pb

logger = logging.getLogger(__name__)

T = TypeVar("T")

# What EmbedStream's bookkeeping holds per input, in order: the answer's expected shape
# (the request went out) or the error that kept the input from being sent.
_Slot = tuple[int, ...] | EmbeddingError


class EmbeddingClient(ClientBase):
    """Blocking client of a tokembed server (see ``ClientBase.__init__`` for arguments)."""

    def _open(self) -> None:
        s = self._settings
        if s.credentials is not None:
            self._channel = grpc.secure_channel(s.target, s.credentials, options=s.options)
        else:
            self._channel = grpc.insecure_channel(s.target, options=s.options)
        # No response deserializers: the client gets the raw bytes and decodes them
        # itself, pointing the array at them instead of copying (see codec/_wire).
        self._embed = self._channel.unary_unary(
            METHOD_EMBED, request_serializer=pb.EmbedRequest.SerializeToString
        )
        self._embed_chunked = self._channel.unary_stream(
            METHOD_EMBED_CHUNKED, request_serializer=pb.EmbedRequest.SerializeToString
        )
        self._embed_stream = self._channel.stream_stream(
            METHOD_EMBED_STREAM, request_serializer=pb.EmbedRequest.SerializeToString
        )
        self._get_model_info = self._channel.unary_unary(
            METHOD_GET_MODEL_INFO,
            request_serializer=pb.GetModelInfoRequest.SerializeToString,
            response_deserializer=pb.ModelInfo.FromString,
        )

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled. Idempotent."""
        if not self._closed:
            self._closed = True
            self._channel.close()

    def __enter__(self) -> EmbeddingClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ calls

    def embed(
        self,
        ids: Any,
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        timeout_s: float | None = None,
        request_id: str = "",
    ) -> npt.NDArray[np.floating]:
        """Embed ids; returns ``[B,S,D]`` (``[B,S_max,D]`` for ragged input, padded with
        the padding id's row) or ``[N,D]`` with ``layout="flat"``.

        The array is a read-only view of the received bytes (zero-copy); ``.copy()`` it
        to write. ``timeout_s`` overrides the client's default for this call.
        """
        return self.embed_result(
            ids, dtype, layout=layout, timeout_s=timeout_s, request_id=request_id
        ).hidden_states

    def embed_result(
        self,
        ids: Any,
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        timeout_s: float | None = None,
        request_id: str = "",
    ) -> EmbedResult:
        """Like :meth:`embed`, with lengths, server timings and the model's name/version."""
        self._check_open()
        layout = codec.check_layout(layout)
        encoded = codec.encode_ids(ids)
        request = codec.build_request(
            encoded,
            dtype=dtype,
            layout=layout,
            model_name=self._settings.model_name,
            request_id=request_id,
        )
        deadline = self._deadline(timeout_s)
        if self._needs_d_model():
            self._fetch_model_info(deadline)
        rows, itemsize = encoded.output_rows(layout), codec.output_itemsize(dtype)
        once = self._chunked_once if self._wants_chunked(rows, itemsize) else self._unary_once
        result = self._with_retries("Embed", deadline, lambda t: once(request, t))
        return decode.check_shape(result, decode.leading_shape(encoded, layout))

    def model_info(self, *, timeout_s: float | None = None) -> ModelInfo:
        """What the server serves, and its limits (always asks the server)."""
        self._check_open()
        return self._fetch_model_info(self._deadline(timeout_s))

    def embed_stream(
        self,
        inputs: Iterable[Any],
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        timeout_s: float | None = None,
    ) -> Iterator[npt.NDArray[np.floating]]:
        """Embed each input over one EmbedStream; yields one array per input, in order.

        A failed input raises its typed error when its turn comes (answers before it have
        been yielded) and ends the stream. ``inputs`` is consumed by a gRPC thread.
        ``timeout_s`` bounds the whole stream; the default is no deadline. Streams are not
        retried (the inputs are consumed as they go).
        """
        for result in self.embed_stream_results(inputs, dtype, layout=layout, timeout_s=timeout_s):
            yield result.hidden_states

    @overload
    def embed_stream_results(
        self,
        inputs: Iterable[Any],
        dtype: codec.OutputDType | str = ...,
        *,
        layout: codec.Layout = ...,
        timeout_s: float | None = ...,
        return_exceptions: Literal[False] = ...,
    ) -> Iterator[EmbedResult]: ...

    @overload
    def embed_stream_results(
        self,
        inputs: Iterable[Any],
        dtype: codec.OutputDType | str = ...,
        *,
        layout: codec.Layout = ...,
        timeout_s: float | None = ...,
        return_exceptions: Literal[True],
    ) -> Iterator[EmbedResult | EmbeddingError]: ...

    def embed_stream_results(
        self,
        inputs: Iterable[Any],
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        timeout_s: float | None = None,
        return_exceptions: bool = False,
    ) -> Iterator[EmbedResult | EmbeddingError]:
        """Like :meth:`embed_stream`, yielding results; with ``return_exceptions=True`` a
        failed input yields its EmbeddingError in its place and the stream goes on."""
        self._check_open()
        layout = codec.check_layout(layout)
        codec.output_dtype_code(dtype)
        slots: collections.deque[_Slot] = collections.deque()
        failure: list[BaseException] = []

        def requests() -> Iterator[pb.EmbedRequest]:
            try:
                for item in inputs:
                    try:
                        encoded = codec.encode_ids(item)
                        request = codec.build_request(
                            encoded,
                            dtype=dtype,
                            layout=layout,
                            model_name=self._settings.model_name,
                        )
                    except EmbeddingError as err:
                        slots.append(err)
                        if not return_exceptions:
                            return  # half-close; the consumer raises err in its turn
                        continue
                    # The slot goes in before the request goes out, so it is there when
                    # the answer comes back.
                    slots.append(decode.leading_shape(encoded, layout))
                    yield request
            except Exception as exc:
                # gRPC would log this and cancel the call; keep it for the caller instead.
                failure.append(exc)

        call = self._embed_stream(requests(), timeout=timeout_s, metadata=self._settings.metadata)
        try:
            try:
                for raw in call:
                    # Inputs refused before sending have no answer: they come first.
                    for refused in _pop_refused(slots):
                        yield _emit(refused, return_exceptions)
                    if not slots:
                        raise protocol_error("EmbedStream sent more answers than requests")
                    leading = slots.popleft()
                    assert isinstance(leading, tuple), "This is a bug."
                    outcome = decode.decode_stream_response(raw)
                    if isinstance(outcome, EmbedResult):
                        outcome = decode.check_shape(outcome, leading)
                    yield _emit(outcome, return_exceptions)
            except grpc.RpcError as exc:
                if failure:
                    raise failure[0] from exc
                raise from_rpc_error(exc) from exc
            for refused in _pop_refused(slots):
                yield _emit(refused, return_exceptions)
            if failure:
                raise failure[0]
            if slots:
                raise protocol_error("EmbedStream ended with requests unanswered")
        finally:
            call.cancel()  # a no-op once the call has finished

    def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        """The standard gRPC health status: "SERVING", "NOT_SERVING", "UNKNOWN", or
        "SERVICE_UNKNOWN" when the server knows no such service. Not retried: a health
        check reports the present. Needs the grpcio-health-checking package."""
        self._check_open()
        health_pb2, health_pb2_grpc = _import_health()
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            response = stub.Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=self._deadline(timeout_s).remaining_s(),
                metadata=self._settings.metadata,
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise from_rpc_error(exc) from exc
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

    # ------------------------------------------------------------------ internals

    def _unary_once(self, request: pb.EmbedRequest, timeout: float | None) -> EmbedResult:
        raw = self._embed(request, timeout=timeout, metadata=self._settings.metadata)
        return decode.decode_response(raw)

    def _chunked_once(self, request: pb.EmbedRequest, timeout: float | None) -> EmbedResult:
        call = self._embed_chunked(request, timeout=timeout, metadata=self._settings.metadata)
        try:
            assembler = decode.ChunkAssembler()
            for raw in call:
                assembler.add(raw)
            return assembler.result()
        finally:
            call.cancel()

    def _fetch_model_info(self, deadline: Deadline) -> ModelInfo:
        info = ModelInfo.from_proto(
            self._with_retries(
                "GetModelInfo",
                deadline,
                lambda t: self._get_model_info(
                    pb.GetModelInfoRequest(), timeout=t, metadata=self._settings.metadata
                ),
            )
        )
        self._d_model = info.d_model
        return info

    def _with_retries(
        self, what: str, deadline: Deadline, attempt: Callable[[float | None], T]
    ) -> T:
        policy = self._settings.retry
        attempts = 0
        while True:
            attempts += 1
            try:
                return attempt(deadline.remaining_s())
            except grpc.RpcError as exc:
                error, cause = from_rpc_error(exc), exc
            if not policy.should_retry(error, attempts):
                raise give_up(error, attempts) from cause
            delay = policy.delay_s(attempts - 1)
            if not deadline.allows_sleep(delay):
                raise give_up(error, attempts) from cause
            logger.info("%s failed (%s); retry %d in %.3f s", what, error, attempts, delay)
            time.sleep(delay)


def _emit(
    outcome: EmbedResult | EmbeddingError, return_exceptions: bool
) -> EmbedResult | EmbeddingError:
    if isinstance(outcome, EmbeddingError) and not return_exceptions:
        raise outcome
    return outcome


def _pop_refused(slots: collections.deque[_Slot]) -> list[EmbeddingError]:
    """Take the inputs at the front that were refused before sending (no answer comes)."""
    refused: list[EmbeddingError] = []
    while slots and isinstance(slots[0], EmbeddingError):
        slot = slots.popleft()
        assert isinstance(slot, EmbeddingError), "This is a bug."
        refused.append(slot)
    return refused


def _import_health() -> tuple[Any, Any]:
    # Imported on use: only `tokembed health` and health-minded callers need the package.
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError as exc:
        raise EmbeddingError(
            "health checks need the grpcio-health-checking package "
            "(pip install grpcio-health-checking)"
        ) from exc
    return health_pb2, health_pb2_grpc
