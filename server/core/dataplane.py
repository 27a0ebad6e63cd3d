"""The data plane: every protocol's requests are served here, the same way.

A front end translates its protocol's message into a ``Request`` (or a ``Refused``: bytes
it could not translate), gives it to the data plane with a ``Sink`` (how its protocol
frames an answer and hands it to its transport), and maps the domain error it may get
back to a status through its own table. Everything else happens here, once:

    route (repository: name, version -> handle)
    read (the operation: a request whose inputs are still where it left them, checked
          against the model before any is read; V2's)
    validate (the operation: request -> job; a bad one fails alone)
    admit (the handle: room in the queue and the output budget, and a lease)
    run (the handle's scheduler: placement, batching, the one deadline check, compute,
         the operation's answer, the sink's frame)
    send (the sink), then release the room and the lease when the sink says the bytes
         are gone
    count (calls: in flight, outcome, metrics and the log, labelled by protocol,
         operation, method and model)

Streams are served here too: answers in order, ``STREAM_WINDOW`` requests worked on ahead
(two more in hand: the one whose answer is being sent, and the one waiting for room), a
failed request answered by the sink's error frame while the stream goes on.
Nothing here imports a transport.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tokembed.server.core.admission import Ticket
from tokembed.server.core.calls import Call, Calls, Delivered, FrontEnd
from tokembed.server.core.errors import EmbedError, Internal
from tokembed.server.core.operations.base import Operation
from tokembed.server.core.repository import ModelHandle, Repository
from tokembed.server.core.served import ServedModel
from tokembed.server.core.types import Answer

logger = logging.getLogger(__name__)

F = TypeVar("F")
R = TypeVar("R")

# What gives each request of a stream its operation.
OperationOf = Callable[["Request[R] | Refused"], Operation[R, Any, Any]]

# A stream is answered in order, but up to this many of its requests are worked on at once.
STREAM_WINDOW = 32


@dataclass(slots=True)
class Request(Generic[R]):
    """One request, translated: which model (and version) it is for, the operation's
    request, and the caller's id to echo."""

    model_name: str
    model_version: str
    body: R
    request_id: str = ""


@dataclass(slots=True)
class ModelQuery:
    """A request naming a model ("": the default one) and a version ("": the newest):
    what a model's info, metadata and readiness are asked with, in every protocol."""

    model_name: str
    model_version: str


class Refused:
    """Bytes a front end could not translate into a request: the error to answer with.

    It keeps the error without its traceback, and ``error`` is a new exception each time:
    the one raised carries the frames that raise it, and were it the one kept here, those
    frames (holding this ``Refused``) and it would make a cycle that holds the request's
    bytes until the cyclic collector runs.
    """

    __slots__ = ("_error", "request_id")

    def __init__(self, error: EmbedError, request_id: str = "") -> None:
        self._error = error.with_traceback(None)
        self._error.__context__ = self._error.__cause__ = None
        self.request_id = request_id

    @property
    def error(self) -> EmbedError:
        return copy.copy(self._error)

    def __repr__(self) -> str:
        return f"Refused({self._error!r}, {self.request_id!r})"


class Sink(ABC, Generic[F]):
    """How a protocol frames an answer and hands it to its transport."""

    @abstractmethod
    def frame(self, answer: Answer, call: Call) -> F:
        """The answer to ``call`` in the protocol's framing (on the event loop or a
        worker thread)."""

    @abstractmethod
    async def send(self, framed: F, sent: Callable[[], None]) -> None:
        """Hand ``framed`` to the transport; call ``sent`` once its bytes are gone (then,
        or later: a unary answer is gone when its call ends)."""


class StreamSink(Sink[F]):
    """A stream's sink: it also frames a failed request as one of the stream's answers."""

    @abstractmethod
    def frame_error(self, error: EmbedError) -> F: ...


def _nothing() -> None:
    pass


@dataclass(slots=True)
class _StreamAnswer(Generic[F]):
    framed: F
    ticket: Ticket | None  # released once sent


class DataPlane:
    def __init__(self, repository: Repository, calls: Calls) -> None:
        self.repository = repository
        self.calls = calls

    # --- answers with a tensor

    async def serve(
        self,
        front_end: FrontEnd,
        method: str,
        operation: Operation[R, Any, Any],
        incoming: Request[R] | Refused,
        deadline: float | None,
        sink: Sink[F],
    ) -> None:
        """Serve one request into ``sink``; raise its ``EmbedError`` if it fails (counted
        already). ``deadline``: ``time.monotonic()`` after which nobody waits."""
        call = self.calls.start(front_end, method, incoming.request_id, operation.name)
        try:
            if not isinstance(incoming, Refused) and operation.unread(incoming.body):
                incoming = await self._read(call, operation, incoming)
            handle, job, ticket = self._prepare(call, operation, incoming)
            try:
                framed, delivered = await handle.scheduler.run(
                    operation, job, deadline, _Framing(sink.frame, call)
                )
                await sink.send(framed, ticket.release)
            except BaseException:
                ticket.release()  # idempotent: a sink that took it may release it later
                raise
            self.calls.served(call, delivered)
        except EmbedError as error:
            self.calls.refused(call, error)
            raise
        except asyncio.CancelledError:
            self.calls.gone(call, deadline)
            raise
        except Exception as exc:
            logger.exception("%s failed", method)
            internal = Internal(f"internal error: {exc}")
            self.calls.refused(call, internal)
            raise internal from exc
        finally:
            self.calls.end()

    async def serve_stream(
        self,
        front_end: FrontEnd,
        method: str,
        operation: Operation[R, Any, Any] | OperationOf[R],
        requests: AsyncIterator[Request[R] | Refused],
        deadline: float | None,
        sink: StreamSink[F],
    ) -> None:
        """Serve a stream of requests into ``sink``, answers in request order.
        ``operation``: every request's, or what gives each request its own (a stream of
        V2's serves the look-up and ``NAME.nearest`` side by side)."""
        operation_of = _same(operation) if isinstance(operation, Operation) else operation
        answers: asyncio.Queue[asyncio.Task[_StreamAnswer[F]] | None] = asyncio.Queue(STREAM_WINDOW)
        unsent: set[asyncio.Task[_StreamAnswer[F]]] = set()  # started, not yet sent

        async def read_requests() -> None:
            try:
                async for incoming in requests:
                    task = asyncio.ensure_future(
                        self._stream_item(
                            front_end, method, operation_of(incoming), incoming, deadline, sink
                        )
                    )
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
                answer = await task
                unsent.discard(task)
                ticket = answer.ticket
                # The answer's room stays held until the transport has taken its bytes:
                # released when framed, a stream whose caller did not read would pin up
                # to STREAM_WINDOW answers that admission no longer counted.
                try:
                    await sink.send(answer.framed, _nothing if ticket is None else ticket.release)
                except BaseException:
                    if ticket is not None:
                        ticket.release()
                    raise
            await reader  # surfaces a failure of the request stream itself
        finally:
            reader.cancel()
            # The stream ended (or its caller left) with answers computing or computed:
            # cancel them, and give back the room of those already done.
            for leftover in unsent:
                leftover.cancel()
                leftover.add_done_callback(_release_unsent)

    async def _stream_item(
        self,
        front_end: FrontEnd,
        method: str,
        operation: Operation[R, Any, Any],
        incoming: Request[R] | Refused,
        deadline: float | None,
        sink: StreamSink[F],
    ) -> _StreamAnswer[F]:
        """One answer of a stream, with the room to release once it is sent."""
        call = self.calls.start(front_end, method, incoming.request_id, operation.name)
        try:
            if not isinstance(incoming, Refused) and operation.unread(incoming.body):
                incoming = await self._read(call, operation, incoming)
            handle, job, ticket = self._prepare(call, operation, incoming)
            try:
                framed, delivered = await handle.scheduler.run(
                    operation, job, deadline, _Framing(sink.frame, call)
                )
            except BaseException:
                ticket.release()
                raise
            self.calls.served(call, delivered)
            return _StreamAnswer(framed, ticket)
        except EmbedError as error:
            self.calls.refused(call, error)
            return _StreamAnswer(sink.frame_error(error), None)
        except asyncio.CancelledError:
            self.calls.gone(call, deadline)
            raise
        except Exception as exc:
            logger.exception("%s item failed", method)
            internal = Internal(f"internal error: {exc}")
            self.calls.refused(call, internal)
            return _StreamAnswer(sink.frame_error(internal), None)
        finally:
            self.calls.end()

    async def _read(
        self, call: Call, operation: Operation[R, Any, Any], incoming: Request[R]
    ) -> Request[R]:
        """The request with its bytes read from where it left them, once what it declares
        fits the model it is routed to (``_prepare`` routes it again: the version may
        have changed while it was read)."""
        handle = self.repository.route(incoming.model_name, incoming.model_version)
        call.model, call.version = handle.name, handle.version
        body = await operation.read(incoming.body, handle.served)
        return Request(incoming.model_name, incoming.model_version, body, incoming.request_id)

    def _prepare(
        self, call: Call, operation: Operation[R, Any, Any], incoming: Request[R] | Refused
    ) -> tuple[ModelHandle, Any, Ticket]:
        """Route, validate, admit: the handle, the job and its ticket, or the error."""
        if isinstance(incoming, Refused):
            raise incoming.error
        handle = self.repository.route(incoming.model_name, incoming.model_version)
        call.model, call.version = handle.name, handle.version
        job = operation.validate(incoming.body, handle.served)
        return handle, job, handle.admit(job)

    # --- answers about the models

    def model_info(
        self, front_end: FrontEnd, method: str, name: str, version: str = ""
    ) -> ServedModel:
        """The model (version) a request for ``name`` (and ``version``) would get."""
        call = Call(front_end, method, "")  # not counted in flight: nothing to drain for
        try:
            served = self.repository.route(name, version).served
        except EmbedError as error:
            self.calls.refused(call, error)
            raise
        call.model, call.version = served.name, served.version
        self.calls.answered(call)
        return served

    def list_models(self, front_end: FrontEnd, method: str) -> tuple[list[ServedModel], str]:
        """Every model served (each in the version a request naming none gets), and the
        default model's name."""
        call = Call(front_end, method, "")
        try:
            self.repository.check_serving()
        except EmbedError as error:
            self.calls.refused(call, error)
            raise
        self.calls.answered(call)
        return self.repository.serving(), self.repository.default_name

    def refuse(self, front_end: FrontEnd, method: str, error: EmbedError) -> None:
        """Count a call its front end refused before it could be served (authentication)."""
        self.calls.refused(Call(front_end, method, ""), error)


class _Framing(Generic[F]):
    """The sink's ``frame`` of one call's answer, timed, with what the answer was (for
    the call's record)."""

    __slots__ = ("_call", "_frame")

    def __init__(self, frame: Callable[[Answer, Call], F], call: Call) -> None:
        self._frame = frame
        self._call = call

    def __call__(self, answer: Answer) -> tuple[F, Delivered]:
        started = time.perf_counter()
        framed = self._frame(answer, self._call)
        encode_s = time.perf_counter() - started
        return framed, Delivered(
            answer.shape, answer.dtype, answer.tokens, answer.nbytes, answer.timings, encode_s
        )


def _same(operation: Operation[R, Any, Any]) -> OperationOf[R]:
    """A stream's every request to ``operation``."""
    return lambda incoming: operation


def _release_unsent(task: asyncio.Task[_StreamAnswer[Any]]) -> None:
    """An answer computed for a stream that ended before sending it: free its room."""
    if not task.cancelled() and task.exception() is None:
        ticket = task.result().ticket
        if ticket is not None:
            ticket.release()
