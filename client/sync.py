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
    METHOD_LIST_MODELS,
    ClientBase,
    Deadline,
    give_up,
)
from tokembed.client.errors import EmbeddingError, from_rpc_error, protocol_error
from tokembed.client.results import EmbedResult, ModelInfo, ModelList
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
        # Bytes both ways: requests are encoded by codec.encode_request, and answers
        # decoded from the raw bytes, pointing the array at them instead of copying
        # (see decode/_wire).
        self._embed = self._channel.unary_unary(METHOD_EMBED)
        self._embed_chunked = self._channel.unary_stream(METHOD_EMBED_CHUNKED)
        self._embed_stream = self._channel.stream_stream(METHOD_EMBED_STREAM)
        self._get_model_info = self._channel.unary_unary(
            METHOD_GET_MODEL_INFO,
            request_serializer=pb.GetModelInfoRequest.SerializeToString,
            response_deserializer=pb.ModelInfo.FromString,
        )
        self._list_models = self._channel.unary_unary(
            METHOD_LIST_MODELS,
            request_serializer=pb.ListModelsRequest.SerializeToString,
            response_deserializer=pb.ListModelsResponse.FromString,
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
        model: str | None = None,
        timeout_s: float | None = None,
        request_id: str = "",
    ) -> npt.NDArray[np.floating]:
        """Embed ids; returns ``[B,S,D]`` (``[B,S_max,D]`` for ragged input, padded with
        the padding id's row) or ``[N,D]`` with ``layout="flat"``.

        The array is a read-only view of the received bytes (zero-copy); ``.copy()`` it
        to write. ``model`` names the model for this call (None: the client's
        ``model_name``; "": the server's default). ``timeout_s`` overrides the client's
        default for this call.
        """
        call, deadline, chunked = self._start_embed(
            ids, dtype, layout, model, timeout_s, request_id
        )
        if chunked:
            result = self._with_retries("Embed", deadline, self._chunked_attempt(call))
            return decode.check_array_shape(result.hidden_states, call.leading_shape)
        raw = self._with_retries("Embed", deadline, self._unary_attempt(call))
        # The array alone: the result object around it is for embed_result's callers.
        return decode.embed_answer(raw, call.leading_shape, call.output_itemsize)

    def embed_result(
        self,
        ids: Any,
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        model: str | None = None,
        timeout_s: float | None = None,
        request_id: str = "",
    ) -> EmbedResult:
        """Like :meth:`embed`, with lengths, server timings and the model's name/version."""
        call, deadline, chunked = self._start_embed(
            ids, dtype, layout, model, timeout_s, request_id
        )
        if chunked:
            result = self._with_retries("Embed", deadline, self._chunked_attempt(call))
        else:
            raw = self._with_retries("Embed", deadline, self._unary_attempt(call))
            result = decode.decode_response(raw)
        return decode.check_shape(result, call.leading_shape)

    def info(self, model: str | None = None, *, timeout_s: float | None = None) -> ModelInfo:
        """One served model and its limits: ``model`` (None: the client's ``model_name``;
        "": the server's default). Always asks the server."""
        self._check_open()
        return self._fetch_model_info(self._model(model), self._deadline(timeout_s))

    model_info = info  # the name of releases before several models; the same method

    def models(self, *, timeout_s: float | None = None) -> ModelList:
        """Every model the server serves, and its default (ListModels)."""
        self._check_open()
        message = self._with_retries(
            "ListModels",
            self._deadline(timeout_s),
            lambda t: self._list_models(
                pb.ListModelsRequest(), timeout=t, metadata=self._settings.metadata
            ),
        )
        return ModelList.from_proto(message)

    def embed_stream(
        self,
        inputs: Iterable[Any],
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        model: str | None = None,
        timeout_s: float | None = None,
    ) -> Iterator[npt.NDArray[np.floating]]:
        """Embed each input over one EmbedStream; yields one array per input, in order.

        A failed input raises its typed error when its turn comes (answers before it have
        been yielded) and ends the stream. ``inputs`` is consumed by a gRPC thread.
        ``timeout_s`` bounds the whole stream; the default is no deadline. Streams are not
        retried (the inputs are consumed as they go). ``model``: as for :meth:`embed`, for
        every input of the stream.
        """
        results = self.embed_stream_results(
            inputs, dtype, layout=layout, model=model, timeout_s=timeout_s
        )
        for result in results:
            yield result.hidden_states

    @overload
    def embed_stream_results(
        self,
        inputs: Iterable[Any],
        dtype: codec.OutputDType | str = ...,
        *,
        layout: codec.Layout = ...,
        model: str | None = ...,
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
        model: str | None = ...,
        timeout_s: float | None = ...,
        return_exceptions: Literal[True],
    ) -> Iterator[EmbedResult | EmbeddingError]: ...

    def embed_stream_results(
        self,
        inputs: Iterable[Any],
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        model: str | None = None,
        timeout_s: float | None = None,
        return_exceptions: bool = False,
    ) -> Iterator[EmbedResult | EmbeddingError]:
        """Like :meth:`embed_stream`, yielding results; with ``return_exceptions=True`` a
        failed input yields its EmbeddingError in its place and the stream goes on."""
        self._check_open()
        layout = codec.check_layout(layout)
        codec.output_dtype_code(dtype)
        model_name = self._model(model)
        slots: collections.deque[_Slot] = collections.deque()
        failure: list[BaseException] = []

        def requests() -> Iterator[bytes]:
            try:
                for item in inputs:
                    try:
                        call = codec.embed_call(item, dtype, layout, model_name=model_name)
                    except EmbeddingError as err:
                        slots.append(err)
                        if not return_exceptions:
                            return  # half-close; the consumer raises err in its turn
                        continue
                    # The slot goes in before the request goes out, so it is there when
                    # the answer comes back.
                    slots.append(call.leading_shape)
                    yield call.request
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

    def _start_embed(
        self,
        ids: Any,
        dtype: Any,
        layout: str,
        model: str | None,
        timeout_s: float | None,
        request_id: str,
    ) -> tuple[codec.EmbedCall, Deadline, bool]:
        """The call encoded, its deadline, and whether to ask for the answer in chunks."""
        self._check_open()
        model_name = self._model(model)
        call = codec.embed_call(ids, dtype, layout, model_name=model_name, request_id=request_id)
        deadline = self._deadline(timeout_s)
        if self._needs_d_model(model_name):
            self._fetch_model_info(model_name, deadline)
        chunked = self._wants_chunked(model_name, call.output_rows, call.output_itemsize)
        return call, deadline, chunked

    def _unary_attempt(self, call: codec.EmbedCall) -> Callable[[float | None], bytes]:
        """One Embed attempt with a given timeout: the answer's raw bytes."""
        embed, request, metadata = self._embed, call.request, self._settings.metadata
        return lambda timeout: embed(request, timeout=timeout, metadata=metadata)

    def _chunked_attempt(self, call: codec.EmbedCall) -> Callable[[float | None], EmbedResult]:
        """One EmbedChunked attempt with a given timeout: the answer reassembled."""

        def attempt(timeout: float | None) -> EmbedResult:
            stream = self._embed_chunked(
                call.request, timeout=timeout, metadata=self._settings.metadata
            )
            try:
                assembler = decode.ChunkAssembler()
                for raw in stream:
                    assembler.add(raw)
                return assembler.result()
            finally:
                stream.cancel()

        return attempt

    def _fetch_model_info(self, model_name: str, deadline: Deadline) -> ModelInfo:
        request = pb.GetModelInfoRequest(model_name=model_name)
        info = ModelInfo.from_proto(
            self._with_retries(
                "GetModelInfo",
                deadline,
                lambda t: self._get_model_info(
                    request, timeout=t, metadata=self._settings.metadata
                ),
            )
        )
        self._d_models[model_name] = info.d_model
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
