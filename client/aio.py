"""The asyncio client: ``AsyncEmbeddingClient``, the same API as ``EmbeddingClient``.

    async with AsyncEmbeddingClient("127.0.0.1:50051") as client:
        hidden = await client.embed([[5, 6, 7, 8, 9, 10, 11, 12]])

The channel is opened on the first call, inside the running event loop: a grpc.aio
channel belongs to the loop it was created in, so one created in ``__init__`` outside
``asyncio.run`` would fail with "attached to a different loop". A client therefore serves
one event loop at a time (after that loop ends, the next one gets a new channel).

A thin shell, as the sync client is: this module does the awaited I/O around what the two
share (``_config``, ``_shared``, ``codec``, ``decode``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Literal, TypeVar, overload

import grpc
import numpy as np
import numpy.typing as npt

from tokembed.client import codec, decode
from tokembed.client._config import ClientBase
from tokembed.client._retry import Deadline
from tokembed.client._shared import Attempts, Health, Methods, StreamBook
from tokembed.client.errors import EmbeddingError
from tokembed.client.results import EmbedResult, ModelInfo, ModelList
from tokembed.v1 import embedding_pb2 as pb

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
        self._methods = Methods(channel)
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
        sequence_first: bool = False,
        model: str | None = None,
        timeout_s: float | None = None,
        request_id: str = "",
        token_types: Any = None,
    ) -> npt.NDArray[np.floating]:
        """See ``EmbeddingClient.embed``; the array is a read-only zero-copy view."""
        call, deadline, model_name = await self._start_embed(
            ids, dtype, layout, model, timeout_s, request_id, sequence_first, token_types
        )
        if self._wants_chunked(model_name, call):
            result = await self._with_retries("Embed", deadline, self._chunked_attempt(call))
            return decode.check_array_shape(result.hidden_states, call.leading_shape)
        raw = await self._with_retries("Embed", deadline, self._unary_attempt(call))
        hidden = decode.embed_answer(raw, call.leading_shape, call.output_itemsize)
        self._learnt(model_name, hidden.shape[-1])
        return hidden

    async def embed_result(
        self,
        ids: Any,
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        sequence_first: bool = False,
        model: str | None = None,
        timeout_s: float | None = None,
        request_id: str = "",
        token_types: Any = None,
    ) -> EmbedResult:
        """See ``EmbeddingClient.embed_result``."""
        call, deadline, model_name = await self._start_embed(
            ids, dtype, layout, model, timeout_s, request_id, sequence_first, token_types
        )
        if self._wants_chunked(model_name, call):
            result = await self._with_retries("Embed", deadline, self._chunked_attempt(call))
        else:
            raw = await self._with_retries("Embed", deadline, self._unary_attempt(call))
            result = decode.decode_response(raw)
            self._learnt(model_name, result.hidden_states.shape[-1])
        return decode.check_shape(result, call.leading_shape, call.sequence_first)

    async def info(self, model: str | None = None, *, timeout_s: float | None = None) -> ModelInfo:
        """See ``EmbeddingClient.info``."""
        self._ensure_open()
        return await self._fetch_model_info(self._model(model), self._deadline(timeout_s))

    model_info = info  # the name of releases before several models; the same method

    async def models(self, *, timeout_s: float | None = None) -> ModelList:
        """See ``EmbeddingClient.models``."""
        self._ensure_open()
        list_models, metadata = self._methods.list_models, self._metadata()
        message = await self._with_retries(
            "ListModels",
            self._deadline(timeout_s),
            lambda t: list_models(pb.ListModelsRequest(), timeout=t, metadata=metadata),
        )
        return ModelList.from_proto(message)

    async def embed_stream(
        self,
        inputs: Iterable[Any] | AsyncIterable[Any],
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        sequence_first: bool = False,
        model: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[npt.NDArray[np.floating]]:
        """See ``EmbeddingClient.embed_stream``; ``inputs`` may also be async."""
        async for result in self.embed_stream_results(
            inputs,
            dtype,
            layout=layout,
            sequence_first=sequence_first,
            model=model,
            timeout_s=timeout_s,
        ):
            yield result.hidden_states

    @overload
    def embed_stream_results(
        self,
        inputs: Iterable[Any] | AsyncIterable[Any],
        dtype: codec.OutputDType | str = ...,
        *,
        layout: codec.Layout = ...,
        sequence_first: bool = ...,
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
        sequence_first: bool = ...,
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
        sequence_first: bool = False,
        model: str | None = None,
        timeout_s: float | None = None,
        return_exceptions: bool = False,
    ) -> AsyncIterator[EmbedResult | EmbeddingError]:
        """See ``EmbeddingClient.embed_stream_results``."""
        self._ensure_open()
        book = StreamBook(dtype, layout, self._model(model), return_exceptions, sequence_first)

        async def requests() -> AsyncIterator[bytes]:
            try:
                async for item in _aiter(inputs):
                    request = book.request(item)
                    if book.stopped:
                        return
                    if request is not None:
                        yield request
            except Exception as exc:
                book.failure = exc

        call = self._methods.embed_stream(requests(), timeout=timeout_s, metadata=self._metadata())
        try:
            try:
                async for raw in call:
                    for outcome in book.answer(raw):
                        yield outcome
            except grpc.RpcError as exc:
                raise book.broken(exc) from exc
            for outcome in book.end():
                yield outcome
            book.check_ended()
        finally:
            call.cancel()

    async def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        """See ``EmbeddingClient.health``."""
        self._ensure_open()
        health = Health(self._channel)
        try:
            response = await health.check(
                health.request(service),
                timeout=self._deadline(timeout_s).remaining_s(),
                metadata=self._metadata(),
            )
        except grpc.RpcError as exc:
            return health.failed(exc)
        return health.status(response)

    # ------------------------------------------------------------------ internals

    async def _start_embed(
        self,
        ids: Any,
        dtype: Any,
        layout: str,
        model: str | None,
        timeout_s: float | None,
        request_id: str,
        sequence_first: bool,
        token_types: Any = None,
    ) -> tuple[codec.EmbedCall, Deadline, str]:
        """See ``EmbeddingClient._start_embed``."""
        self._ensure_open()
        call, deadline, model_name = self._embed_call(
            ids, dtype, layout, model, timeout_s, request_id, sequence_first, token_types
        )
        return call, deadline, model_name

    def _unary_attempt(self, call: codec.EmbedCall) -> Callable[[float | None], Awaitable[bytes]]:
        """One Embed attempt with a given timeout: the answer's raw bytes."""
        embed, request, metadata = self._methods.embed, call.request, self._metadata()
        return lambda timeout: embed(request, timeout=timeout, metadata=metadata)

    def _chunked_attempt(
        self, call: codec.EmbedCall
    ) -> Callable[[float | None], Awaitable[EmbedResult]]:
        """One EmbedChunked attempt with a given timeout: the answer reassembled."""

        async def attempt(timeout: float | None) -> EmbedResult:
            stream = self._methods.embed_chunked(
                call.request, timeout=timeout, metadata=self._metadata()
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
        get, metadata = self._methods.get_model_info, self._metadata()
        message = await self._with_retries(
            "GetModelInfo", deadline, lambda t: get(request, timeout=t, metadata=metadata)
        )
        info = ModelInfo.from_proto(message)
        self._learnt(model_name, info.d_model)
        return info

    async def _with_retries(
        self, what: str, deadline: Deadline, attempt: Callable[[float | None], Awaitable[T]]
    ) -> T:
        attempts = Attempts(what, self._settings.retry, deadline, self._is_open)
        while True:
            try:
                return await attempt(attempts.timeout())
            except grpc.RpcError as exc:
                await asyncio.sleep(attempts.failed(exc))


async def _aiter(inputs: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    if isinstance(inputs, AsyncIterable):
        async for item in inputs:
            yield item
    else:
        for item in inputs:
            yield item
