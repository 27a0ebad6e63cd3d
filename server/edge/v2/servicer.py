"""The Open Inference Protocol front end (KServe V2, Triton's ``inference.GRPCInferenceService``):
translate, hand to the data plane, frame through a sink.

ModelInfer and ModelStreamInfer are tokembed.v1's Embed and EmbedStream in this
protocol's messages: the request bytes became a data plane ``Request`` in gRPC's
deserializer (``requests``); the data plane serves it (route, validate, admit, run, count)
into a sink that frames a ``ModelInferResponse`` by hand (``responses``); a domain error
becomes a status through this protocol's table (``status``), or, inside a stream, an
``error_message`` while the stream goes on. The other methods describe the server and its
models, read from the data plane (ModelMetadata, ModelConfig: counted as ``model_info``),
from the repository (ServerReady, ModelReady, RepositoryIndex) or from the metrics' totals
(ModelStatistics); those and ServerLive and ServerMetadata are probes, not counted, as
gRPC's health service is not.

The service is registered by hand under Triton's name: the generated classes are in the
package ``tokembed.v2`` (see protos/tokembed/v2/grpc_service.proto for why), and the
inference methods answer with bytes already encoded (no serializer).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from typing import Any

import grpc

from tokembed.export.manifest import OUTPUT_NAME
from tokembed.server.core.calls import Call, FrontEnd, ModelTotals
from tokembed.server.core.control import ModelControl
from tokembed.server.core.dataplane import DataPlane, ModelQuery, Refused, Request
from tokembed.server.core.errors import (
    EmbedError,
    InvalidInput,
    ModelNotFound,
    ModelUnloaded,
    Unavailable,
)
from tokembed.server.core.operations.base import Operation
from tokembed.server.core.operations.detokenize import DETOKENIZE
from tokembed.server.core.operations.embed import EMBED
from tokembed.server.core.operations.embed_text import EMBED_TEXT
from tokembed.server.core.operations.nearest import NEAREST
from tokembed.server.core.operations.tokenize import TOKENIZE
from tokembed.server.core.served import ServedModel
from tokembed.server.core.types import Answer
from tokembed.server.edge.auth import Identities
from tokembed.server.edge.deadlines import deadline_of
from tokembed.server.edge.grpc_sinks import GrpcStreamItemSink, GrpcUnarySink
from tokembed.server.edge.status_codes import refuse
from tokembed.server.edge.v2 import nearest, responses
from tokembed.server.edge.v2.nearest import NearestCall
from tokembed.server.edge.v2.repository_service import RepositoryService
from tokembed.server.edge.v2.requests import (
    CallersInput,
    InferCall,
    InferParser,
    parse_message,
    parse_model_query,
)
from tokembed.server.edge.v2.shm import SharedMemoryRegistry
from tokembed.server.edge.v2.shm_service import (
    SharedMemoryService,
    SharedMemorySink,
    TensorsSharedMemorySink,
    names_region,
    output_window,
    output_windows,
)
from tokembed.server.edge.v2.status import V2, status_name, status_of
from tokembed.server.edge.v2.text import DetokenizeCall, TextCall, TextsInRegion, as_tensors
from tokembed.v2 import grpc_service_pb2 as pb

SERVICE_NAME = "inference.GRPCInferenceService"
SERVER_NAME = "tokembed"
# The protocol extensions served (ServerMetadata): Triton's model configuration
# (ModelConfig) and statistics (ModelStatistics).
EXTENSIONS = ("model_configuration", "statistics")
FRONT_END = FrontEnd(
    protocol="v2",
    methods={
        "ModelInfer": "embed",
        "ModelStreamInfer": "embed",
        "ModelMetadata": "model_info",
        "ModelConfig": "model_info",
    },
    status_of=status_name,
)
_abort = V2.abort  # a call ended with a domain error, by this protocol's table


class InferenceServicer:
    def __init__(
        self,
        dataplane: DataPlane,
        *,
        parse: InferParser,
        max_message_bytes: int,
        version: str,
        statistics: Callable[[str], ModelTotals | None],
        identities: Identities,
        extensions: Sequence[str] = EXTENSIONS,
        shared_memory: SharedMemoryRegistry | None = None,
        control: ModelControl | None = None,
    ) -> None:
        """``parse``: ModelInfer's deserializer; ``max_message_bytes``: the message limit
        ModelConfig reports; ``version``: tokembed's (ServerMetadata); ``statistics``: a
        model name's totals (None: none yet); ``identities``: who a call comes from (whose
        shared-memory regions it may use); ``shared_memory``: the system shared-memory
        regions (None: the extension's methods are not served); ``control``: the control
        plane the repository methods drive (None: RepositoryIndex lists what is served,
        and models are neither loaded nor unloaded)."""
        self.repository = None if control is None else RepositoryService(control)
        self.parse = parse
        self.shared_memory = (
            None
            if shared_memory is None
            else SharedMemoryService(shared_memory, _abort, identities)
        )
        self._regions = shared_memory
        self._identities = identities
        self._dataplane = dataplane
        self._max_message_bytes = max_message_bytes
        self._version = version
        self._statistics = statistics
        self._extensions = list(extensions)

    # --- inference

    async def ModelInfer(
        self,
        request: InferCall | NearestCall | TextCall | DetokenizeCall | Refused,
        context: grpc.aio.ServicerContext,
    ) -> bytes:
        if isinstance(request, (TextCall, DetokenizeCall)):
            return await self._text(request, context)
        if not isinstance(request, (InferCall, Refused)):  # NAME.nearest: v2.nearest
            nearest_call, tensors = self._nearest_sink(request, context)
            try:
                await self._dataplane.serve(
                    FRONT_END, "ModelInfer", NEAREST, nearest_call, deadline_of(context), tensors
                )
            except EmbedError as error:
                refuse(context, status_of(error), error)
            return tensors.payload
        request, sink = self.unary_sink(self._sent_by(request, context), context)
        try:
            await self._dataplane.serve(
                FRONT_END, "ModelInfer", EMBED, request, deadline_of(context), sink
            )
        except EmbedError as error:
            refuse(context, status_of(error), error)  # not an abort: see refuse
        return sink.payload

    async def _text(
        self, request: TextCall | DetokenizeCall, context: grpc.aio.ServicerContext
    ) -> bytes:
        """Texts: tokenized, or embedded, as the requested outputs say; or ids detokenized
        (``edge.v2.text``)."""
        operation = operation_of(request)
        sent, sink = self._text_sink(request, context)
        try:
            await self._dataplane.serve(
                FRONT_END, "ModelInfer", operation, sent, deadline_of(context), sink
            )
        except EmbedError as error:
            refuse(context, status_of(error), error)
        return sink.payload

    def _text_sink(
        self, request: TextCall | DetokenizeCall, context: grpc.aio.ServicerContext
    ) -> tuple[Request[Any] | Refused, TensorsSink | TensorsSharedMemorySink]:
        """A text request told its caller (whose region its texts may be read from), and
        where its answer goes: the response, or a region per requested output that names
        one (their windows held until the RPC ends). A window that cannot be had refuses
        the request, through the data plane."""
        if not isinstance(request, TextCall):
            return request, TensorsSink(context)
        self._tell_caller(request, context)
        if self._regions is None or not any(names_region(o.parameters) for o in request.outputs):
            return request, TensorsSink(context)
        try:
            windows = output_windows(
                self._regions, request.outputs, partial(self._identities.of, context)
            )
        except EmbedError as error:
            return Refused(error, request.request_id), TensorsSink(context)
        return request, TensorsSharedMemorySink(context, windows)

    def _tell_caller(self, request: TextCall, context: grpc.aio.ServicerContext) -> None:
        texts = request.body.texts
        if isinstance(texts, TextsInRegion) and isinstance(texts.source, CallersInput):
            texts.source.caller = self._identities.of(context)

    def unary_sink(
        self, request: InferCall | Refused, context: grpc.aio.ServicerContext
    ) -> tuple[InferCall | Refused, UnarySink | SharedMemorySink]:
        """Where ModelInfer's answer goes: the response's ``raw_output_contents``, or the
        shared-memory region its requested output names. A window that cannot be had
        refuses the request (through the data plane, counted as any refusal)."""
        if isinstance(request, InferCall) and self._regions is not None:
            try:
                window = output_window(
                    self._regions, request.outputs, partial(self._identities.of, context)
                )
            except EmbedError as error:
                return Refused(error, request.request_id), UnarySink(context)
            if window is not None:
                return request, SharedMemorySink(context, window)
        return request, UnarySink(context)

    def _nearest_sink(
        self, request: NearestCall, context: grpc.aio.ServicerContext
    ) -> tuple[NearestCall | Refused, TensorsSink | TensorsSharedMemorySink]:
        """A nearest request told its caller (whose region its vectors may be read from),
        and where its answer goes: the response, or a region per requested output that
        names one (their windows held until the RPC ends). A window that cannot be had
        refuses the request, through the data plane."""
        request = self._nearest_sent_by(request, context)
        if self._regions is None or not any(names_region(o.parameters) for o in request.outputs):
            return request, TensorsSink(context)
        try:
            windows = output_windows(
                self._regions, request.outputs, partial(self._identities.of, context)
            )
        except EmbedError as error:
            return Refused(error, request.request_id), TensorsSink(context)
        return request, TensorsSharedMemorySink(context, windows)

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[
            InferCall | NearestCall | TextCall | DetokenizeCall | Refused
        ],
        context: grpc.aio.ServicerContext,
    ) -> None:
        await self._dataplane.serve_stream(
            FRONT_END, "ModelStreamInfer", operation_of,
            self._in_the_stream(request_iterator, context),
            deadline_of(context), StreamItemSink(context),
        )  # fmt: skip

    def _nearest_sent_by(
        self, request: NearestCall, context: grpc.aio.ServicerContext
    ) -> NearestCall:
        """A nearest request, its vectors in a shared-memory region told whose regions
        they may be read from: the caller's."""
        vectors = request.body.data
        if isinstance(vectors, CallersInput):
            vectors.caller = self._identities.of(context)
        return request

    def _sent_by(
        self, request: InferCall | Refused, context: grpc.aio.ServicerContext
    ) -> InferCall | Refused:
        """The request, its inputs in shared-memory regions told whose regions they may
        read: the caller's (the data plane reads them)."""
        if isinstance(request, InferCall) and request.callers_inputs:
            request.sent_by(self._identities.of(context))
        return request

    async def _in_the_stream(
        self,
        requests: AsyncIterator[InferCall | NearestCall | TextCall | DetokenizeCall | Refused],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Request[Any] | Refused]:
        """A stream's requests, told their caller; one asking for an answer in shared
        memory is refused (a stream's answers are its messages; ModelInfer writes answers
        into regions). Texts, ids to detokenize and ``NAME.nearest``'s vectors are served
        as ModelInfer serves them (``operation_of``)."""
        async for request in requests:
            if isinstance(request, DetokenizeCall):
                yield request
            elif isinstance(request, TextCall):
                in_region = [o.name for o in request.outputs if names_region(o.parameters)]
                if in_region:
                    yield Refused(
                        InvalidInput(
                            f"output {in_region[0]} names a shared-memory region: "
                            "ModelStreamInfer answers in the stream; use ModelInfer for "
                            "answers in shared memory"
                        ),
                        request.request_id,
                    )
                else:
                    self._tell_caller(request, context)
                    yield request
            elif isinstance(request, NearestCall):
                in_region = [o.name for o in request.outputs if names_region(o.parameters)]
                if in_region:
                    yield Refused(
                        InvalidInput(
                            f"output {in_region[0]!r} of model "
                            f"{request.model_name + nearest.SUFFIX!r} names a shared-memory "
                            "region: ModelStreamInfer answers in the stream; use ModelInfer "
                            "for answers in shared memory"
                        ),
                        request.request_id,
                    )
                else:
                    yield self._nearest_sent_by(request, context)
            elif isinstance(request, InferCall) and any(
                names_region(output.parameters) for output in request.outputs
            ):
                yield Refused(
                    InvalidInput(
                        f"output {OUTPUT_NAME} names a shared-memory region: ModelStreamInfer "
                        "answers in the stream; use ModelInfer for answers in shared memory"
                    ),
                    request.request_id,
                )
            else:
                yield self._sent_by(request, context)

    # --- the server and its models

    async def ServerLive(
        self, request: None, context: grpc.aio.ServicerContext
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)  # it answers: the process is up

    async def ServerReady(
        self, request: None, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._dataplane.repository.ready)

    async def ServerMetadata(
        self, request: None, context: grpc.aio.ServicerContext
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name=SERVER_NAME, version=self._version, extensions=self._extensions
        )

    async def ModelReady(
        self, request: ModelQuery | Refused, context: grpc.aio.ServicerContext
    ) -> pb.ModelReadyResponse:
        """Ready: a request for this model (version) would be served now. A model loading
        or draining is not ready; a model not served is NOT_FOUND."""
        try:
            if isinstance(request, Refused):
                raise request.error
            base = nearest.base_name(request.model_name)
            routed = self._dataplane.repository.route(
                request.model_name if base is None else base, request.model_version
            )
            if base is not None and routed.served.backend.head is None:
                return pb.ModelReadyResponse(ready=False)
        except (Unavailable, ModelUnloaded):
            return pb.ModelReadyResponse(ready=False)
        except ModelNotFound as error:
            # A version not served of a model served: not ready (it may be loaded).
            assert not isinstance(request, Refused)
            if request.model_version and self._versions(
                request.model_name or self._dataplane.repository.default_name
            ):
                return pb.ModelReadyResponse(ready=False)
            await _abort(context, error)
        except EmbedError as error:
            await _abort(context, error)
        return pb.ModelReadyResponse(ready=True)

    async def ModelMetadata(
        self, request: ModelQuery | Refused, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        base = None if isinstance(request, Refused) else nearest.base_name(request.model_name)
        if base is not None:
            assert not isinstance(request, Refused)
            query = ModelQuery(base, request.model_version)
            served = await self._model_info("ModelMetadata", query, context)
            try:
                return nearest.model_metadata(served, self._versions(served.name))
            except EmbedError as error:
                await _abort(context, error)
        served = await self._model_info("ModelMetadata", request, context)
        return responses.model_metadata(served, self._versions(served.name))

    async def ModelConfig(
        self, request: ModelQuery | Refused, context: grpc.aio.ServicerContext
    ) -> pb.ModelConfigResponse:
        base = None if isinstance(request, Refused) else nearest.base_name(request.model_name)
        if base is not None:
            assert not isinstance(request, Refused)
            query = ModelQuery(base, request.model_version)
            served = await self._model_info("ModelConfig", query, context)
            try:
                return nearest.model_config(served, self._max_message_bytes)
            except EmbedError as error:
                await _abort(context, error)
        served = await self._model_info("ModelConfig", request, context)
        return responses.model_config(served, self._max_message_bytes)

    async def ModelStatistics(
        self, request: ModelQuery | Refused, context: grpc.aio.ServicerContext
    ) -> pb.ModelStatisticsResponse:
        """Per model name (every version together: tokembed counts by name); a name ""
        asks for every model."""
        try:
            if isinstance(request, Refused):
                raise request.error
            if request.model_name:
                routed = self._dataplane.repository.route(request.model_name, request.model_version)
                names = [routed.name]
            else:
                names = list(dict.fromkeys(handle.name for handle in self._dataplane.repository))
        except EmbedError as error:
            await _abort(context, error)
        return pb.ModelStatisticsResponse(
            model_stats=[_statistics(name, self._statistics(name)) for name in names]
        )

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest | Refused, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryIndexResponse:
        if isinstance(request, Refused):
            await _abort(context, request.error)
        held = [(h.name, h.version, h.state.value) for h in self._dataplane.repository]
        return responses.repository_index(held, request.ready)

    async def _model_info(
        self, method: str, request: ModelQuery | Refused, context: grpc.aio.ServicerContext
    ) -> ServedModel:
        try:
            if isinstance(request, Refused):
                self._dataplane.refuse(FRONT_END, method, request.error)
                raise request.error
            return self._dataplane.model_info(
                FRONT_END, method, request.model_name, request.model_version
            )
        except EmbedError as error:
            await _abort(context, error)

    def _versions(self, name: str) -> list[str]:
        """The versions of ``name`` that requests may name now."""
        return [h.version for h in self._dataplane.repository
                if h.name == name and h.state.value == "ready"]  # fmt: skip


def _statistics(name: str, totals: ModelTotals | None) -> pb.ModelStatistics:
    stats = pb.ModelStatistics(name=name)
    if totals is None:
        return stats
    stats.last_inference = int(totals.last_served_unix_s * 1000)
    stats.inference_count = totals.success_count
    stats.execution_count = totals.batches
    inference = stats.inference_stats
    for field, count, seconds in (
        (inference.success, totals.success_count, totals.success_s),
        (inference.fail, totals.fail_count, totals.fail_s),
        (inference.queue, totals.queue_count, totals.queue_s),
        (inference.compute_infer, totals.batches, totals.compute_s),
    ):
        field.count = count
        field.ns = int(seconds * 1e9)
    return stats


# --- the sinks: how this protocol frames an answer and hands it to gRPC


class UnarySink(GrpcUnarySink):
    """ModelInfer: one ModelInferResponse."""

    def frame(self, answer: Answer, call: Call) -> bytes:
        return responses.infer_response(answer, OUTPUT_NAME, call.request_id)


class TensorsSink(GrpcUnarySink):
    """ModelInfer of an answer of several named tensors (NAME.nearest's, a tokenizer's) or
    of texts (a BYTES output): one ModelInferResponse with an output each."""

    def frame(self, answer: Answer, call: Call) -> bytes:
        return responses.tensors_infer_response(as_tensors(answer), call.request_id)


class StreamItemSink(GrpcStreamItemSink):
    """ModelStreamInfer: each answer (or a request's error) as the stream's next message;
    an answer of several named tensors (NAME.nearest's, texts in) or of texts as ModelInfer
    frames it."""

    def frame(self, answer: Answer, call: Call) -> bytes:
        answer = as_tensors(answer)
        if answer.several:
            return responses.tensors_stream_response(answer, call.request_id)
        return responses.stream_response(answer, OUTPUT_NAME, call.request_id)

    def frame_error(self, error: EmbedError) -> bytes:
        return responses.stream_error(str(error))


def operation_of(request: object) -> Operation[Any, Any, Any]:
    """The operation a ModelInfer or ModelStreamInfer request gets: NAME.nearest's vectors
    searched, its texts tokenized or embedded, its ids detokenized, else its ids embedded
    (a refused one is counted as an embed)."""
    if isinstance(request, NearestCall):
        return NEAREST
    if isinstance(request, TextCall):
        return TOKENIZE if request.tokenize else EMBED_TEXT
    if isinstance(request, DetokenizeCall):
        return DETOKENIZE
    return EMBED


def _unary(
    handler: Callable[..., Any],
    parse: Callable[[bytes], Any],
    serialize: Callable[[Any], bytes] | None,
) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(handler, parse, serialize)


def generic_handler(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """The methods, registered by hand under Triton's service name."""

    def ignored(data: bytes) -> None:
        """The request of a probe has no fields: whatever came, the answer is the same."""

    def reply(cls: Any) -> Callable[[Any], bytes]:
        return cls.SerializeToString  # type: ignore[no-any-return]

    query = parse_model_query
    handlers: dict[str, grpc.RpcMethodHandler] = {
        "ModelInfer": _unary(servicer.ModelInfer, servicer.parse, None),
        "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
            servicer.ModelStreamInfer, servicer.parse
        ),
        "ServerLive": _unary(servicer.ServerLive, ignored, reply(pb.ServerLiveResponse)),
        "ServerReady": _unary(servicer.ServerReady, ignored, reply(pb.ServerReadyResponse)),
        "ServerMetadata": _unary(
            servicer.ServerMetadata,
            ignored,
            reply(pb.ServerMetadataResponse),
        ),
        "ModelReady": _unary(
            servicer.ModelReady, query(pb.ModelReadyRequest), reply(pb.ModelReadyResponse)
        ),
        "ModelMetadata": _unary(
            servicer.ModelMetadata,
            query(pb.ModelMetadataRequest),
            reply(pb.ModelMetadataResponse),
        ),
        "ModelConfig": _unary(
            servicer.ModelConfig, query(pb.ModelConfigRequest), reply(pb.ModelConfigResponse)
        ),
        "ModelStatistics": _unary(
            servicer.ModelStatistics,
            query(pb.ModelStatisticsRequest),
            reply(pb.ModelStatisticsResponse),
        ),
        "RepositoryIndex": _unary(
            servicer.RepositoryIndex,
            parse_message(pb.RepositoryIndexRequest),
            reply(pb.RepositoryIndexResponse),
        ),
    }
    if servicer.shared_memory is not None:
        handlers.update(servicer.shared_memory.handlers(parse_message))
    if servicer.repository is not None:
        handlers.update(servicer.repository.handlers(parse_message))
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
