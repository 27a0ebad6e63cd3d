"""The asyncio client: ``AsyncEmbeddingClient``, the same API as ``EmbeddingClient``.

    async with AsyncEmbeddingClient("127.0.0.1:50051") as client:
        hidden = await client.embed([[5, 6, 7, 8, 9, 10, 11, 12]])

The channel is opened on the first call, inside the running event loop: a grpc.aio
channel belongs to the loop it was created in, so one created in ``__init__`` outside
``asyncio.run`` would fail with "attached to a different loop". A client therefore serves
one event loop at a time (after that loop ends, the next one gets a new channel).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
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
from tokembed.client.sync import _emit, _import_health, _pop_refused, _Slot
from tokembed.v1 import embedding_pb2 as pb

logger = logging.getLogger(__name__)

T = TypeVar("T")


class AsyncEmbeddingClient(ClientBase):
    """asyncio client of a tokembed server (see ``ClientBase.__init__`` for arguments)."""

    _channel: Any = None  # grpc.aio.Channel, opened in the running loop by _ensure_open
    _loop: asyncio.AbstractEventLoop | None = None

    def _ensure_open(self) -> None:
        self._check_open()
        loop = asyncio.get_running_loop()
        if self._channel is not None:
            if loop is self._loop:
                return
            if self._loop is not None and not self._loop.is_closed():
                raise EmbeddingError(
                    "an AsyncEmbeddingClient serves one event loop at a time, and the loop "
                    "it was first used in is still open; create one client per event loop"
                )
            # Its loop has ended (e.g. a second asyncio.run): that channel is unusable and
            # cannot be closed any more; open a new one in this loop.
            self._channel = None
        s = self._settings
        if s.credentials is not None:
            channel = grpc.aio.secure_channel(s.target, s.credentials, options=s.options)
        else:
            channel = grpc.aio.insecure_channel(s.target, options=s.options)
        # Bytes both ways, as in the sync client (encoded by codec, decoded by decode).
        self._embed = channel.unary_unary(METHOD_EMBED)
        self._embed_chunked = channel.unary_stream(METHOD_EMBED_CHUNKED)
        self._embed_stream = channel.stream_stream(METHOD_EMBED_STREAM)
        self._get_model_info = channel.unary_unary(
            METHOD_GET_MODEL_INFO,
            request_serializer=pb.GetModelInfoRequest.SerializeToString,
            response_deserializer=pb.ModelInfo.FromString,
        )
        self._list_models = channel.unary_unary(
            METHOD_LIST_MODELS,
            request_serializer=pb.ListModelsRequest.SerializeToString,
            response_deserializer=pb.ListModelsResponse.FromString,
        )
        self._channel, self._loop = channel, loop

    # ------------------------------------------------------------------ lifecycle

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled. Idempotent."""
        self._closed = True
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> AsyncEmbeddingClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ calls

    async def embed(
        self,
        ids: Any,
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        model: str | None = None,
        timeout_s: float | None = None,
        request_id: str = "",
    ) -> npt.NDArray[np.floating]:
        """See ``EmbeddingClient.embed``; the array is a read-only zero-copy view."""
        call, deadline, chunked = await self._start_embed(
            ids, dtype, layout, model, timeout_s, request_id
        )
        if chunked:
            result = await self._with_retries("Embed", deadline, self._chunked_attempt(call))
            return decode.check_array_shape(result.hidden_states, call.leading_shape)
        raw = await self._with_retries("Embed", deadline, self._unary_attempt(call))
        return decode.embed_answer(raw, call.leading_shape, call.output_itemsize)

    async def embed_result(
        self,
        ids: Any,
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        model: str | None = None,
        timeout_s: float | None = None,
        request_id: str = "",
    ) -> EmbedResult:
        """See ``EmbeddingClient.embed_result``."""
        call, deadline, chunked = await self._start_embed(
            ids, dtype, layout, model, timeout_s, request_id
        )
        if chunked:
            result = await self._with_retries("Embed", deadline, self._chunked_attempt(call))
        else:
            raw = await self._with_retries("Embed", deadline, self._unary_attempt(call))
            result = decode.decode_response(raw)
        return decode.check_shape(result, call.leading_shape)

    async def info(self, model: str | None = None, *, timeout_s: float | None = None) -> ModelInfo:
        """See ``EmbeddingClient.info``."""
        self._ensure_open()
        return await self._fetch_model_info(self._model(model), self._deadline(timeout_s))

    model_info = info  # the name of releases before several models; the same method

    async def models(self, *, timeout_s: float | None = None) -> ModelList:
        """See ``EmbeddingClient.models``."""
        self._ensure_open()
        message = await self._with_retries(
            "ListModels",
            self._deadline(timeout_s),
            lambda t: self._list_models(
                pb.ListModelsRequest(), timeout=t, metadata=self._settings.metadata
            ),
        )
        return ModelList.from_proto(message)

    async def embed_stream(
        self,
        inputs: Iterable[Any] | AsyncIterable[Any],
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        model: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[npt.NDArray[np.floating]]:
        """See ``EmbeddingClient.embed_stream``; ``inputs`` may also be async."""
        async for result in self.embed_stream_results(
            inputs, dtype, layout=layout, model=model, timeout_s=timeout_s
        ):
            yield result.hidden_states

    @overload
    def embed_stream_results(
        self,
        inputs: Iterable[Any] | AsyncIterable[Any],
        dtype: codec.OutputDType | str = ...,
        *,
        layout: codec.Layout = ...,
        model: str | None = ...,
        timeout_s: float | None = ...,
        return_exceptions: Literal[False] = ...,
    ) -> AsyncIterator[EmbedResult]: ...

    @overload
    def embed_stream_results(
        self,
        inputs: Iterable[Any] | AsyncIterable[Any],
        dtype: codec.OutputDType | str = ...,
        *,
        layout: codec.Layout = ...,
        model: str | None = ...,
        timeout_s: float | None = ...,
        return_exceptions: Literal[True],
    ) -> AsyncIterator[EmbedResult | EmbeddingError]: ...

    async def embed_stream_results(
        self,
        inputs: Iterable[Any] | AsyncIterable[Any],
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        model: str | None = None,
        timeout_s: float | None = None,
        return_exceptions: bool = False,
    ) -> AsyncIterator[EmbedResult | EmbeddingError]:
        """See ``EmbeddingClient.embed_stream_results``."""
        self._ensure_open()
        layout = codec.check_layout(layout)
        codec.output_dtype_code(dtype)
        model_name = self._model(model)
        slots: collections.deque[_Slot] = collections.deque()
        failure: list[BaseException] = []

        async def requests() -> AsyncIterator[bytes]:
            try:
                async for item in _aiter(inputs):
                    try:
                        call = codec.embed_call(item, dtype, layout, model_name=model_name)
                    except EmbeddingError as err:
                        slots.append(err)
                        if not return_exceptions:
                            return
                        continue
                    slots.append(call.leading_shape)
                    yield call.request
            except Exception as exc:
                failure.append(exc)

        call = self._embed_stream(requests(), timeout=timeout_s, metadata=self._settings.metadata)
        try:
            try:
                async for raw in call:
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
            call.cancel()

    async def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        """See ``EmbeddingClient.health``."""
        self._ensure_open()
        health_pb2, health_pb2_grpc = _import_health()
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            response = await stub.Check(
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

    async def _start_embed(
        self,
        ids: Any,
        dtype: Any,
        layout: str,
        model: str | None,
        timeout_s: float | None,
        request_id: str,
    ) -> tuple[codec.EmbedCall, Deadline, bool]:
        """See ``EmbeddingClient._start_embed``."""
        self._ensure_open()
        model_name = self._model(model)
        call = codec.embed_call(ids, dtype, layout, model_name=model_name, request_id=request_id)
        deadline = self._deadline(timeout_s)
        if self._needs_d_model(model_name):
            await self._fetch_model_info(model_name, deadline)
        chunked = self._wants_chunked(model_name, call.output_rows, call.output_itemsize)
        return call, deadline, chunked

    def _unary_attempt(self, call: codec.EmbedCall) -> Callable[[float | None], Awaitable[bytes]]:
        """One Embed attempt with a given timeout: the answer's raw bytes."""
        embed, request, metadata = self._embed, call.request, self._settings.metadata
        return lambda timeout: embed(request, timeout=timeout, metadata=metadata)

    def _chunked_attempt(
        self, call: codec.EmbedCall
    ) -> Callable[[float | None], Awaitable[EmbedResult]]:
        """One EmbedChunked attempt with a given timeout: the answer reassembled."""

        async def attempt(timeout: float | None) -> EmbedResult:
            stream = self._embed_chunked(
                call.request, timeout=timeout, metadata=self._settings.metadata
            )
            try:
                assembler = decode.ChunkAssembler()
                async for raw in stream:
                    assembler.add(raw)
                return assembler.result()
            finally:
                stream.cancel()

        return attempt

    async def _fetch_model_info(self, model_name: str, deadline: Deadline) -> ModelInfo:
        request = pb.GetModelInfoRequest(model_name=model_name)
        message = await self._with_retries(
            "GetModelInfo",
            deadline,
            lambda t: self._get_model_info(request, timeout=t, metadata=self._settings.metadata),
        )
        info = ModelInfo.from_proto(message)
        self._d_models[model_name] = info.d_model
        return info

    async def _with_retries(
        self, what: str, deadline: Deadline, attempt: Callable[[float | None], Awaitable[T]]
    ) -> T:
        policy = self._settings.retry
        attempts = 0
        while True:
            attempts += 1
            try:
                return await attempt(deadline.remaining_s())
            except grpc.RpcError as exc:
                error, cause = from_rpc_error(exc), exc
            if not policy.should_retry(error, attempts):
                raise give_up(error, attempts) from cause
            delay = policy.delay_s(attempts - 1)
            if not deadline.allows_sleep(delay):
                raise give_up(error, attempts) from cause
            logger.info("%s failed (%s); retry %d in %.3f s", what, error, attempts, delay)
            await asyncio.sleep(delay)


async def _aiter(inputs: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    if isinstance(inputs, AsyncIterable):
        async for item in inputs:
            yield item
    else:
        for item in inputs:
            yield item
