"""The gRPC servicer: translate, call the data plane, translate back. Nothing else.

Responses are returned as pre-encoded bytes (see ``wire.py``), so the method handlers
are registered by hand with a serializer that passes bytes through; GetModelInfo still
returns a message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import NoReturn

import grpc
import numpy as np

from tokembed.server import inplace_bytes, wire
from tokembed.server.admission import Ticket
from tokembed.server.answer_arrays import AnswerArrays
from tokembed.server.domain import EmbedOutput, Timings
from tokembed.server.errors import EmbedError, Internal, InvalidInput
from tokembed.server.in_place_answer import InPlaceAnswer
from tokembed.server.metrics import Metrics
from tokembed.server.rpc_outcomes import RpcOutcomes
from tokembed.server.service import EmbeddingService
from tokembed.server.serving_state import InFlight, ServingState
from tokembed.server.status import status_of, trailing_metadata
from tokembed.v1 import embedding_pb2 as pb

logger = logging.getLogger(__name__)

SERVICE_NAME = "tokembed.v1.EmbeddingService"
# A call cancelled less than this before its deadline counts as deadline exceeded.
DEADLINE_SLACK_S = 0.05
# EmbedStream answers in order but works ahead on up to this many requests at once.
STREAM_WINDOW = 32
# One EmbedStream answer: its bytes, and the room it holds until they are sent.
_StreamAnswer = tuple[bytes, Ticket | None]


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class EmbeddingServicer:
    def __init__(
        self,
        state: ServingState,
        metrics: Metrics | None = None,
        spare_bytes: inplace_bytes.SpareBytes | None = None,
        answer_arrays: AnswerArrays | None = None,
    ) -> None:
        """``spare_bytes``: reused for in-place answers (its owner lets it go when idle);
        None: every in-place answer gets fresh bytes. ``answer_arrays``: the same for
        EmbedChunked's answers; None: each gets a new array."""
        self._state = state
        self._outcomes = RpcOutcomes(metrics)
        # Whether answers may be built in place on this interpreter (fixed at import).
        self._in_place = wire.InPlaceResponse.available()
        self._allocate = None if spare_bytes is None else spare_bytes.allocate
        self._answer_arrays = answer_arrays

    # --- RPCs

    async def Embed(self, request: wire.ParsedRequest, context: grpc.aio.ServicerContext) -> bytes:
        started = time.perf_counter()
        with self._inflight():
            try:
                # The commonest request is answered at once (see _answer_plain); any other
                # goes the general way.
                plain_payload = self._answer_plain(request, context, started)
                if plain_payload is not None:
                    return plain_payload
                service = self._state.ready_service()
                in_place = None
                if self._in_place:
                    in_place = InPlaceAnswer(service, request.request_id, self._allocate)
                output, ticket = await service.embed(
                    wire.to_domain(request), _deadline(context), answer_into=in_place
                )
                # The output bytes stay reserved until gRPC has sent them.
                _when_sent(ticket.release)
                payload, encode_s = await self._encode(
                    service, output, request.request_id, started,
                    None if in_place is None else in_place.response,
                )  # fmt: skip
            except EmbedError as error:
                await self._abort(context, "Embed", error, started)
            except asyncio.CancelledError:
                self._gone(context, "Embed", started)
                raise
            except Exception as exc:
                logger.exception("Embed failed")
                await self._abort(context, "Embed", Internal(f"internal error: {exc}"), started)
            self._outcomes.served("Embed", output, started, encode_s)
            return payload

    async def EmbedStream(
        self,
        request_iterator: AsyncIterator[wire.ParsedRequest],
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
                # Fix: the stream is over and nobody reads the queue; waiting there to
                # put the end marker (a full queue: the caller sent more than the window
                # and left) hung this task until the garbage collector destroyed it.
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
                # Fix: the answer's bytes stay reserved until gRPC has taken them. Released
                # at encode time, a stream whose caller did not read pinned up to
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
        self, request: wire.ParsedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        started = time.perf_counter()
        with self._inflight():
            try:
                service = self._state.ready_service()
                output, ticket = await service.embed(
                    wire.to_domain(request), _deadline(context), answer_into=self._answer_array
                )
            except EmbedError as error:
                await self._abort(context, "EmbedChunked", error, started)
            except asyncio.CancelledError:
                self._gone(context, "EmbedChunked", started)
                raise
            except Exception as exc:
                # Fix: as in Embed; without this an unexpected failure reached gRPC as
                # UNKNOWN, uncounted, instead of INTERNAL with the traceback logged.
                logger.exception("EmbedChunked failed")
                internal = Internal(f"internal error: {exc}")
                await self._abort(context, "EmbedChunked", internal, started)
            try:
                array = output.hidden_states
                if getattr(array.base, "nbytes", 0) > array.nbytes:
                    # A view into a shared batch output would keep the whole batch alive
                    # for as long as this (possibly slow) reader takes, while admission
                    # counts only this answer: own a copy instead.
                    array = array.copy()
                metadata = self._metadata(service, output, request.request_id, started)
                yield wire.encode_chunk_header(array, metadata)
                flat = array.data.cast("B")
                step = service.settings.stream_chunk_bytes
                for offset in range(0, array.nbytes, step):
                    yield wire.encode_chunk_data(flat[offset : offset + step])
            except asyncio.CancelledError:
                self._gone(context, "EmbedChunked", started)
                raise
            finally:
                ticket.release()
            self._outcomes.served("EmbedChunked", output, started, encode_s=None)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest | None, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        started = time.perf_counter()
        try:
            if request is None:
                raise InvalidInput("the request is not a valid tokembed.v1.GetModelInfoRequest")
            service = self._state.ready_service()
        except EmbedError as error:
            await self._abort(context, "GetModelInfo", error, started)
        answer = wire.model_info(service.info, service.settings)
        self._outcomes.done("GetModelInfo", grpc.StatusCode.OK, started)
        return answer

    # --- helpers

    async def _stream_item(
        self, request: wire.ParsedRequest, context: grpc.aio.ServicerContext
    ) -> _StreamAnswer:
        """One answer of EmbedStream, with the ticket to release once it is sent."""
        started = time.perf_counter()
        try:
            service = self._state.ready_service()
            with self._inflight():
                output, ticket = await service.embed(wire.to_domain(request), _deadline(context))
                try:
                    payload, encode_s = await self._encode(
                        service, output, request.request_id, started
                    )
                except BaseException:
                    ticket.release()
                    raise
        except EmbedError as error:
            code = status_of(error)
            self._outcomes.rejected("EmbedStream", error.reason, code, started, str(error))
            return wire.encode_stream_error(code.value[0], str(error), error.reason), None
        except asyncio.CancelledError:
            self._gone(context, "EmbedStream", started)
            raise
        except Exception as exc:
            logger.exception("EmbedStream item failed")
            code = grpc.StatusCode.INTERNAL
            self._outcomes.rejected("EmbedStream", "internal", code, started, str(exc))
            answer = wire.encode_stream_error(code.value[0], f"internal error: {exc}", "internal")
            return answer, None
        self._outcomes.served("EmbedStream", output, started, encode_s)
        return wire.encode_stream_answer(payload), ticket

    def _metadata(
        self, service: EmbeddingService, output: EmbedOutput, request_id: str, started: float
    ) -> bytes:
        manifest = service.info.model.manifest
        return wire.response_metadata(
            output, manifest.name, manifest.version, request_id, time.perf_counter() - started
        )

    def _answer_plain(
        self, request: wire.ParsedRequest, context: grpc.aio.ServicerContext, started: float
    ) -> bytes | None:
        """The commonest request's answer, made flat; None, with nothing done, for any
        other request (``EmbeddingService.embed_plain`` says which).

        Flat: no await, the answer's rows joined straight into the response (never an
        array: see ``RowBytes``), one metrics update for the RPC. Live, every step and
        await costs several times what it costs in a loop (docs/benchmarks, fifth and
        seventh rounds). Not while loading or draining: ``ready_service`` refuses those
        on the general path.
        """
        state = self._state
        service = state.service
        plain = wire.plain_ids(request)
        if plain is None or service is None or state.draining:
            return None
        answer = service.embed_plain(*plain, _deadline(context))
        if answer is None:
            return None
        # The output bytes stay reserved until gRPC has sent them.
        _when_sent(answer.ticket.release)
        manifest = service.info.model.manifest
        metadata = wire.answer_metadata(
            answer.timings, None, manifest.name, manifest.version, request.request_id,
            time.perf_counter() - started,
        )  # fmt: skip
        encode_started = time.perf_counter()
        payload = wire.encode_rows_response(answer.shape, answer.pieces, metadata)
        self._outcomes.served_plain(
            "Embed", answer.shape, answer.timings, started, time.perf_counter() - encode_started
        )
        return payload

    async def _encode(
        self,
        service: EmbeddingService,
        output: EmbedOutput,
        request_id: str,
        started: float,
        in_place: wire.InPlaceResponse | None = None,
    ) -> tuple[bytes, float]:
        """The response's bytes, and the seconds their encode took."""
        metadata = self._metadata(service, output, request_id, started)
        encode_started = time.perf_counter()
        payload = None if in_place is None else in_place.finish(metadata)
        if payload is None:
            array = output.hidden_states
            payload = await service.offloader.run(
                array.nbytes, wire.encode_response, array, metadata
            )
        return payload, time.perf_counter() - encode_started

    def _answer_array(
        self,
        shape: tuple[int, ...],
        dtype: np.dtype,
        lengths: tuple[int, ...] | None,
        known: Timings,
    ) -> np.ndarray:
        """Where EmbedChunked's large answers are gathered: straight into the array its
        chunks are cut from. Otherwise the look-up's rows come first and are then copied
        into the padded answer, and both are alive at the peak."""
        if self._answer_arrays is None:
            return np.empty(shape, dtype=dtype)
        return self._answer_arrays.take(shape, dtype)

    def _inflight(self) -> InFlight:
        return InFlight(self._state)

    def _gone(self, context: grpc.aio.ServicerContext, method: str, started: float) -> None:
        """The handler was cancelled: the caller went away, or its deadline passed.

        gRPC cancels the handler in both cases; only the time left tells them apart.
        The caller's own timer fires a moment before ours (its grpc-timeout was measured
        before the request travelled), so its cancel can arrive first, just before our
        deadline: a call cancelled that close to its deadline ran out of time.
        """
        remaining = context.time_remaining()
        if remaining is not None and remaining <= DEADLINE_SLACK_S:
            code = grpc.StatusCode.DEADLINE_EXCEEDED
            self._outcomes.rejected(method, "deadline_exceeded", code, started, "deadline passed")
        else:
            self._outcomes.rejected(
                method, "cancelled", grpc.StatusCode.CANCELLED, started, "caller left"
            )

    async def _abort(
        self, context: grpc.aio.ServicerContext, method: str, error: EmbedError, started: float
    ) -> NoReturn:
        code = status_of(error)
        self._outcomes.rejected(method, error.reason, code, started, str(error))
        await context.abort(code, str(error), trailing_metadata=trailing_metadata(error))
        raise AssertionError("this is a bug: context.abort returned")


def _when_sent(release: Callable[[], None]) -> None:
    """Call ``release`` once gRPC is done sending this unary RPC's answer (or gave up).

    Not ``context.add_done_callback``: gRPC keeps that callback in a list held by the
    call's state, which the context holds, while the callback holds the context: a
    reference cycle per RPC (14 objects, the call's state among them) that only the
    cyclic garbage collector frees; ~20 us of server CPU per tiny request at
    concurrency 64, measured. The handler runs inside the RPC's task, which ends once
    the answer's batch is done (gRPC runs its own done callbacks from that task's), so
    the task's done callback comes at the same moment, without the cycle.
    """
    task = asyncio.current_task()
    assert task is not None, "This is a bug: gRPC runs every handler in a task."
    task.add_done_callback(lambda _: release())


def _release_unsent(task: asyncio.Task[_StreamAnswer]) -> None:
    """An answer computed for a stream that ended before sending it: free its room."""
    if not task.cancelled() and task.exception() is None:
        ticket = task.result()[1]
        if ticket is not None:
            ticket.release()


def generic_handler(servicer: EmbeddingServicer) -> grpc.GenericRpcHandler:
    handlers: dict[str, grpc.RpcMethodHandler] = {
        "Embed": grpc.unary_unary_rpc_method_handler(
            servicer.Embed, wire.parse_request, wire.serialize_response
        ),
        "EmbedStream": grpc.stream_stream_rpc_method_handler(
            servicer.EmbedStream, wire.parse_request, wire.serialize_response
        ),
        "EmbedChunked": grpc.unary_stream_rpc_method_handler(
            servicer.EmbedChunked, wire.parse_request, wire.serialize_response
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, wire.parse_model_info_request, wire.serialize_response
        ),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
