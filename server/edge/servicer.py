"""The tokembed.v1 servicer: translate, call the model's engine, translate back.

Every Embed, EmbedStream request and EmbedChunked request takes the same steps once
each: parsed (``requests``, as gRPC's deserializer), its model's engine found
(``registry``), served by it (validate, admit, look up, answer: ``core.engine``), encoded
(``responses``, called by the engine where its policy runs the look-up), and counted
(``calls``). Domain errors become status codes through one table (``status_codes``).

The Embed methods answer with bytes already encoded, so they are registered by hand
with no serializer; GetModelInfo and ListModels return messages.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import NoReturn, TypeVar

import grpc

from tokembed.server.core.admission import Ticket
from tokembed.server.core.engine import Engine, Served
from tokembed.server.core.errors import EmbedError, Internal, ran_out_of_time
from tokembed.server.core.registry import ModelRegistry
from tokembed.server.core.types import Answer, EmbedInput
from tokembed.server.edge import responses
from tokembed.server.edge.calls import Call, Calls
from tokembed.server.edge.requests import (
    EmbedCall,
    EmbedParser,
    ModelQuery,
    Refused,
    parse_list_models,
    parse_model_query,
)
from tokembed.server.edge.status_codes import status_of, trailing_metadata
from tokembed.v1 import embedding_pb2 as pb

logger = logging.getLogger(__name__)

SERVICE_NAME = "tokembed.v1.EmbeddingService"
# EmbedStream answers in order but works ahead on up to this many requests at once.
STREAM_WINDOW = 32
T = TypeVar("T")
# One EmbedStream answer: its bytes, and the room it holds until they are sent.
_StreamAnswer = tuple[bytes, Ticket | None]


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class EmbeddingServicer:
    def __init__(
        self,
        registry: ModelRegistry,
        calls: Calls,
        *,
        chunk_bytes: int,
        max_message_bytes: int,
        parse: EmbedParser,
    ) -> None:
        """``chunk_bytes``: slice size of EmbedChunked answers; ``max_message_bytes``: the
        message limit GetModelInfo reports; ``parse``: the Embed methods' deserializer."""
        self.parse = parse
        self._registry = registry
        self._calls = calls
        self._chunk_bytes = chunk_bytes
        self._max_message_bytes = max_message_bytes

    # --- RPCs

    async def Embed(self, request: EmbedCall | Refused, context: grpc.aio.ServicerContext) -> bytes:
        calls = self._calls
        call = calls.start("Embed", _request_id(request))
        try:
            _, served = await self._serve(request, context, call, _unary_encoder)
            # The answer's bytes stay counted by admission until gRPC is done sending
            # them (or gives up): the RPC's end, which this documented callback marks.
            context.add_done_callback(served.ticket.release)
            payload, encode_s = served.payload
            calls.served(call, served, encode_s)
            return payload
        finally:
            calls.end()

    async def EmbedStream(
        self,
        request_iterator: AsyncIterator[EmbedCall | Refused],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[bytes]:
        answers: asyncio.Queue[asyncio.Task[_StreamAnswer] | None] = asyncio.Queue(STREAM_WINDOW)
        unsent: set[asyncio.Task[_StreamAnswer]] = set()  # started, not yet handed to gRPC

        async def read_requests() -> None:
            try:
                async for request in request_iterator:
                    task = asyncio.ensure_future(self._stream_item(request, context))
                    unsent.add(task)
                    await answers.put(task)
            except asyncio.CancelledError:
                # The stream is over and nobody reads the queue; waiting there to put the
                # end marker (a full queue: the caller sent more than the window and
                # left) would hang this task until the garbage collector destroyed it.
                raise
            except BaseException:
                await answers.put(None)
                raise
            await answers.put(None)

        reader = asyncio.ensure_future(read_requests())
        try:
            while (task := await answers.get()) is not None:
                payload, ticket = await task
                unsent.discard(task)
                # The answer's bytes stay reserved until gRPC has taken them: released
                # at encode time, a stream whose caller did not read would pin up to
                # STREAM_WINDOW answers that admission no longer counted.
                try:
                    yield payload
                finally:
                    if ticket is not None:
                        ticket.release()
            await reader  # surfaces a failure of the request stream itself
        finally:
            reader.cancel()
            # The stream ended (or its caller left) with answers computing or computed:
            # cancel them, and give back the room of those already done.
            for leftover in unsent:
                leftover.cancel()
                leftover.add_done_callback(_release_unsent)

    async def EmbedChunked(
        self, request: EmbedCall | Refused, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        calls = self._calls
        call = calls.start("EmbedChunked", _request_id(request))
        try:
            engine, served = await self._serve(request, context, call, _chunks_later)
            try:
                chunks = responses.chunked_response(
                    served.payload, engine.name, engine.served.version, call.request_id,
                    time.perf_counter() - call.started, self._chunk_bytes,
                )  # fmt: skip
                for chunk in chunks:
                    yield chunk
            except asyncio.CancelledError:
                self._gone(context, call)
                raise
            finally:
                served.ticket.release()
            calls.served(call, served, encode_s=None)
        finally:
            calls.end()

    async def GetModelInfo(
        self, request: ModelQuery | Refused, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        call = Call("GetModelInfo", "")  # not counted in flight: nothing to drain for
        try:
            if isinstance(request, Refused):
                raise request.error
            engine = self._registry.engine(request.model_name)
            call.model = engine.name
        except EmbedError as error:
            await self._abort(context, call, error)
        answer = responses.model_info(engine.served, self._max_message_bytes)
        self._calls.answered(call)
        return answer

    async def ListModels(
        self, request: Refused | None, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        call = Call("ListModels", "")
        registry = self._registry
        try:
            if isinstance(request, Refused):
                raise request.error
            registry.check_serving()
        except EmbedError as error:
            await self._abort(context, call, error)
        answer = responses.list_models(
            [engine.served for engine in registry], registry.default_name, self._max_message_bytes
        )
        self._calls.answered(call)
        return answer

    # --- helpers

    async def _serve(
        self,
        request: EmbedCall | Refused,
        context: grpc.aio.ServicerContext,
        call: Call,
        encoder: Callable[[Engine, Call], Callable[[Answer], T]],
    ) -> tuple[Engine, Served[T]]:
        """One unary request served by its model's engine, encoded by ``encoder(engine,
        call)``; anything that refuses it aborts the RPC with its status."""
        try:
            engine, embed_input = self._resolve(request, call)
            served = await engine.embed(embed_input, _deadline(context), encoder(engine, call))
        except EmbedError as error:
            await self._abort(context, call, error)
        except asyncio.CancelledError:
            self._gone(context, call)
            raise
        except Exception as exc:
            logger.exception("%s failed", call.method)
            await self._abort(context, call, Internal(f"internal error: {exc}"))
        return engine, served

    def _resolve(self, request: EmbedCall | Refused, call: Call) -> tuple[Engine, EmbedInput]:
        """The engine of the request's model, and its input; raises what refuses it."""
        if isinstance(request, Refused):
            raise request.error
        engine = self._registry.engine(request.model_name)
        call.model = engine.name
        return engine, request.input

    async def _stream_item(
        self, request: EmbedCall | Refused, context: grpc.aio.ServicerContext
    ) -> _StreamAnswer:
        """One answer of EmbedStream, with the room to release once it is sent."""
        calls = self._calls
        call = calls.start("EmbedStream", _request_id(request))
        try:
            engine, embed_input = self._resolve(request, call)
            served = await engine.embed(
                embed_input, _deadline(context), _unary_encoder(engine, call)
            )
        except EmbedError as error:
            code = status_of(error)
            calls.refused(call, error.reason, code, str(error))
            return responses.stream_error(code.value[0], str(error), error.reason), None
        except asyncio.CancelledError:
            self._gone(context, call)
            raise
        except Exception as exc:
            logger.exception("EmbedStream item failed")
            code = grpc.StatusCode.INTERNAL
            calls.refused(call, "internal", code, str(exc))
            answer = responses.stream_error(code.value[0], f"internal error: {exc}", "internal")
            return answer, None
        finally:
            calls.end()
        payload, encode_s = served.payload
        calls.served(call, served, encode_s)
        return responses.stream_answer(payload), served.ticket

    def _gone(self, context: grpc.aio.ServicerContext, call: Call) -> None:
        """The handler was cancelled: the caller went away, or its deadline passed.

        gRPC cancels the handler in both cases; only the time left tells them apart, by
        the same rule as the batcher's drops (errors.ran_out_of_time).
        """
        if ran_out_of_time(_deadline(context), time.monotonic()):
            code = grpc.StatusCode.DEADLINE_EXCEEDED
            self._calls.refused(call, "deadline_exceeded", code, "deadline passed")
        else:
            self._calls.refused(call, "cancelled", grpc.StatusCode.CANCELLED, "caller left")

    async def _abort(
        self, context: grpc.aio.ServicerContext, call: Call, error: EmbedError
    ) -> NoReturn:
        code = status_of(error)
        self._calls.refused(call, error.reason, code, str(error))
        await context.abort(code, str(error), trailing_metadata=trailing_metadata(error))
        raise AssertionError("this is a bug: context.abort returned")


def _request_id(request: EmbedCall | Refused) -> str:
    return request.request_id if isinstance(request, EmbedCall) else ""


def _unary_encoder(engine: Engine, call: Call) -> functools.partial[tuple[bytes, float]]:
    """How the engine encodes this request's answer, where it looked it up: an
    ``EmbedResponse``'s bytes, and the seconds the encode took."""
    served = engine.served
    return functools.partial(
        responses.timed_embed_response, served.name, served.version, call.request_id,
        call.started,
    )  # fmt: skip


def _chunks_later(engine: Engine, call: Call) -> Callable[[Answer], Answer]:
    """EmbedChunked's "encode": none yet; its chunks are made as they are sent."""
    return _as_is


def _as_is(answer: Answer) -> Answer:
    return answer


def _release_unsent(task: asyncio.Task[_StreamAnswer]) -> None:
    """An answer computed for a stream that ended before sending it: free its room."""
    if not task.cancelled() and task.exception() is None:
        ticket = task.result()[1]
        if ticket is not None:
            ticket.release()


def generic_handler(servicer: EmbeddingServicer) -> grpc.GenericRpcHandler:
    """The methods, registered by hand: the Embed methods' answers are bytes already, so
    they have no serializer (gRPC sends bytes as they are)."""
    handlers: dict[str, grpc.RpcMethodHandler] = {
        "Embed": grpc.unary_unary_rpc_method_handler(servicer.Embed, servicer.parse),
        "EmbedStream": grpc.stream_stream_rpc_method_handler(servicer.EmbedStream, servicer.parse),
        "EmbedChunked": grpc.unary_stream_rpc_method_handler(servicer.EmbedChunked, servicer.parse),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, parse_model_query, pb.ModelInfo.SerializeToString
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, parse_list_models, pb.ListModelsResponse.SerializeToString
        ),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
