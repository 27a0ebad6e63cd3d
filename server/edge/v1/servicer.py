"""The tokembed.v1 front end: translate, hand to the data plane, frame through a sink.

Each RPC is a translation: its request bytes became a data plane ``Request`` in gRPC's
deserializer (``requests``); the data plane serves it (route, validate, admit, run,
count: ``core.dataplane``) into one of the sinks below, which frame the answer
(``responses``) and hand it to gRPC; a domain error becomes a status through one table
(``edge.status_codes``).

The Embed methods answer with bytes already encoded, so they are registered by hand
with no serializer; GetModelInfo and ListModels return messages.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from tokembed.server.core.calls import Call, FrontEnd
from tokembed.server.core.dataplane import DataPlane, ModelQuery, Refused, Request, Sink
from tokembed.server.core.errors import EmbedError
from tokembed.server.core.operations.base import Operation
from tokembed.server.core.operations.detokenize import DETOKENIZE
from tokembed.server.core.operations.embed import EMBED
from tokembed.server.core.operations.embed_text import EMBED_TEXT
from tokembed.server.core.operations.nearest import NEAREST
from tokembed.server.core.operations.text_request import DetokenizeInput, TextInput
from tokembed.server.core.operations.tokenize import TOKENIZE
from tokembed.server.core.texts_answer import TextsAnswer
from tokembed.server.core.types import Answer, Buffer
from tokembed.server.edge.deadlines import deadline_of
from tokembed.server.edge.grpc_sinks import GrpcStreamItemSink, GrpcUnarySink
from tokembed.server.edge.status_codes import refuse, status_name, status_of
from tokembed.server.edge.v1 import responses, text
from tokembed.server.edge.v1.requests import (
    EmbedCall,
    EmbedParser,
    NearestCall,
    NearestParser,
    parse_list_models,
    parse_model_query,
)
from tokembed.v1 import embedding_pb2 as pb

SERVICE_NAME = "tokembed.v1.EmbeddingService"
FRONT_END = FrontEnd(
    protocol="tokembed.v1",
    methods={
        "Embed": "embed",
        "EmbedStream": "embed",
        "EmbedChunked": "embed",
        "GetModelInfo": "model_info",
        "ListModels": "list_models",
        "Nearest": "nearest",
        "NearestChunked": "nearest",
        "Tokenize": "tokenize",
        "Detokenize": "detokenize",
        "EmbedText": "embed_text",
        "EmbedTextChunked": "embed_text",
    },
    status_of=status_name,
)


class EmbeddingServicer:
    def __init__(
        self,
        dataplane: DataPlane,
        *,
        chunk_bytes: int,
        max_message_bytes: int,
        parse: EmbedParser,
        parse_nearest: NearestParser | None = None,
    ) -> None:
        """``chunk_bytes``: slice size of EmbedChunked answers; ``max_message_bytes``: the
        message limit GetModelInfo reports; ``parse``: the Embed methods' deserializer."""
        self.parse = parse
        self.parse_nearest = parse_nearest or NearestParser(max_message_bytes)
        self.parse_text = {
            method: text.TextParser(parser, parse.max_bytes, parse.max_tokens)
            for method, parser in (
                ("Tokenize", text.parse_tokenize),
                ("Detokenize", text.parse_detokenize),
                ("EmbedText", text.parse_embed_text),
            )
        }
        self._dataplane = dataplane
        self._chunk_bytes = chunk_bytes
        self._max_message_bytes = max_message_bytes

    # --- RPCs

    async def Embed(self, request: EmbedCall | Refused, context: grpc.aio.ServicerContext) -> bytes:
        sink = _UnarySink(context)
        await self._serve("Embed", request, context, sink)
        return sink.payload

    async def EmbedChunked(
        self, request: EmbedCall | Refused, context: grpc.aio.ServicerContext
    ) -> None:
        sink = _ChunkedSink(context, self._chunk_bytes)
        await self._serve("EmbedChunked", request, context, sink)

    async def EmbedStream(
        self,
        request_iterator: AsyncIterator[EmbedCall | Refused],
        context: grpc.aio.ServicerContext,
    ) -> None:
        await self._dataplane.serve_stream(
            FRONT_END, "EmbedStream", EMBED, request_iterator, deadline_of(context),
            _StreamItemSink(context),
        )  # fmt: skip

    async def Nearest(
        self, request: NearestCall | Refused, context: grpc.aio.ServicerContext
    ) -> bytes:
        sink = _TensorsSink(context)
        await self._serve("Nearest", request, context, sink, NEAREST)
        return sink.payload

    async def NearestChunked(
        self, request: NearestCall | Refused, context: grpc.aio.ServicerContext
    ) -> None:
        sink = _ChunkedSink(context, self._chunk_bytes, responses.tensors_chunk_header)
        await self._serve("NearestChunked", request, context, sink, NEAREST)

    async def Tokenize(
        self, request: Request[TextInput] | Refused, context: grpc.aio.ServicerContext
    ) -> bytes:
        sink = _TensorsSink(context)
        await self._serve("Tokenize", request, context, sink, TOKENIZE)
        return sink.payload

    async def EmbedText(
        self, request: Request[TextInput] | Refused, context: grpc.aio.ServicerContext
    ) -> bytes:
        sink = _TensorsSink(context)
        await self._serve("EmbedText", request, context, sink, EMBED_TEXT)
        return sink.payload

    async def EmbedTextChunked(
        self, request: Request[TextInput] | Refused, context: grpc.aio.ServicerContext
    ) -> None:
        sink = _ChunkedSink(context, self._chunk_bytes, responses.tensors_chunk_header)
        await self._serve("EmbedTextChunked", request, context, sink, EMBED_TEXT)

    async def Detokenize(
        self, request: Request[DetokenizeInput] | Refused, context: grpc.aio.ServicerContext
    ) -> bytes:
        sink = _TextsSink(context)
        await self._serve("Detokenize", request, context, sink, DETOKENIZE)
        return sink.payload

    async def GetModelInfo(
        self, request: ModelQuery | Refused, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        try:
            if isinstance(request, Refused):
                self._dataplane.refuse(FRONT_END, "GetModelInfo", request.error)
                raise request.error
            served = self._dataplane.model_info(
                FRONT_END, "GetModelInfo", request.model_name, request.model_version
            )
        except EmbedError as error:
            refuse(context, status_of(error), error)
            return pb.ModelInfo()
        return responses.model_info(served, self._max_message_bytes)

    async def ListModels(
        self, request: Refused | None, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        try:
            if isinstance(request, Refused):
                self._dataplane.refuse(FRONT_END, "ListModels", request.error)
                raise request.error
            served, default = self._dataplane.list_models(FRONT_END, "ListModels")
        except EmbedError as error:
            refuse(context, status_of(error), error)
            return pb.ListModelsResponse()
        return responses.list_models(served, default, self._max_message_bytes)

    async def _serve(
        self,
        method: str,
        request: Request[Any] | Refused,
        context: grpc.aio.ServicerContext,
        sink: Sink[Any],
        operation: Operation[Any, Any, Any] = EMBED,
    ) -> None:
        try:
            await self._dataplane.serve(
                FRONT_END, method, operation, request, deadline_of(context), sink
            )
        except EmbedError as error:
            refuse(context, status_of(error), error)


# --- the sinks: how tokembed.v1 frames an answer and hands it to gRPC


def _server_s(call: Call) -> float:
    """The answer's ``timings.server_seconds``: from the request's decoding until now."""
    return time.perf_counter() - call.started


class _UnarySink(GrpcUnarySink):
    """Embed: one EmbedResponse."""

    def frame(self, answer: Answer, call: Call) -> bytes:
        return responses.embed_response(answer, call.request_id, _server_s(call))


class _TensorsSink(GrpcUnarySink):
    """An answer of several named tensors (Nearest, Tokenize, EmbedText): one
    TensorsResponse."""

    def frame(self, answer: Answer, call: Call) -> bytes:
        return responses.tensors_response(answer, call.request_id, _server_s(call))


class _TextsSink(GrpcUnarySink):
    """Detokenize: one DetokenizeResponse."""

    def frame(self, answer: Answer, call: Call) -> bytes:
        assert isinstance(answer, TextsAnswer), "This is a bug: an answer of texts."
        return text.detokenize_response(answer, call.request_id)


class _ChunkedSink(Sink[tuple[bytes, list[Buffer]]]):
    """EmbedChunked, NearestChunked and EmbedTextChunked: a header (``header``: EmbedChunked's, or a
    TensorsChunk's), then the answer's bytes in slices (an answer of several tensors: each
    tensor's pieces after the one before it), each made as it is written (so an answer is
    never whole in memory twice)."""

    def __init__(
        self,
        context: grpc.aio.ServicerContext,
        chunk_bytes: int,
        header: Callable[[Answer, str, float], bytes] = responses.chunk_header,
    ) -> None:
        self._context = context
        self._chunk_bytes = chunk_bytes
        self._header = header

    def frame(self, answer: Answer, call: Call) -> tuple[bytes, list[Buffer]]:
        header = self._header(answer, call.request_id, _server_s(call))
        if answer.several:
            return header, [piece for tensor in answer.tensors for piece in tensor.pieces]
        return header, list(answer.pieces)

    async def send(self, framed: tuple[bytes, list[Buffer]], sent: Callable[[], None]) -> None:
        header, pieces = framed
        try:
            await self._context.write(header)
            for chunk in responses.chunk_slices(pieces, self._chunk_bytes):
                await self._context.write(chunk)
        finally:
            pieces.clear()  # the rows: nothing refers to them once written
            sent()


class _StreamItemSink(GrpcStreamItemSink):
    """EmbedStream: each answer (or a request's error) as the stream's next message."""

    def frame(self, answer: Answer, call: Call) -> bytes:
        return responses.stream_answer(
            responses.embed_response(answer, call.request_id, _server_s(call))
        )

    def frame_error(self, error: EmbedError) -> bytes:
        code = status_of(error)
        return responses.stream_error(code.value[0], str(error), error.reason)


def generic_handler(servicer: EmbeddingServicer) -> grpc.GenericRpcHandler:
    """The methods, registered by hand: the Embed methods' answers are bytes already, so
    they have no serializer (gRPC sends bytes as they are)."""
    handlers: dict[str, grpc.RpcMethodHandler] = {
        "Embed": grpc.unary_unary_rpc_method_handler(servicer.Embed, servicer.parse),
        "EmbedStream": grpc.stream_stream_rpc_method_handler(servicer.EmbedStream, servicer.parse),
        "EmbedChunked": grpc.unary_stream_rpc_method_handler(servicer.EmbedChunked, servicer.parse),
        "Nearest": grpc.unary_unary_rpc_method_handler(servicer.Nearest, servicer.parse_nearest),
        "NearestChunked": grpc.unary_stream_rpc_method_handler(
            servicer.NearestChunked, servicer.parse_nearest
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, parse_model_query, pb.ModelInfo.SerializeToString
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, parse_list_models, pb.ListModelsResponse.SerializeToString
        ),
        # Their answers are bytes already, as Embed's.
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            servicer.Tokenize, servicer.parse_text["Tokenize"]
        ),
        "Detokenize": grpc.unary_unary_rpc_method_handler(
            servicer.Detokenize, servicer.parse_text["Detokenize"]
        ),
        "EmbedText": grpc.unary_unary_rpc_method_handler(
            servicer.EmbedText, servicer.parse_text["EmbedText"]
        ),
        "EmbedTextChunked": grpc.unary_stream_rpc_method_handler(
            servicer.EmbedTextChunked, servicer.parse_text["EmbedText"]
        ),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
