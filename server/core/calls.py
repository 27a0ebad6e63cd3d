"""The calls' bookkeeping: how many are in flight (the drain waits for them), when the last
one came, and how each ended, told to the metrics and the log here, whatever the protocol.
(The scheduler reports its batches and drops itself, and a refusal of a method no front
end serves, such as reflection's, is counted as a rejection by the server's wiring.)

Refusals are logged so that a flood does not drown the log (a drain under load refuses
every call that arrives): per reason, the first refusal in full as a WARNING, then one
summary line per interval ("N more rejected (unavailable) in the last 10 s"); each
refusal also has its own line at DEBUG. The metrics count every one.

A front end describes itself once (``FrontEnd``: its protocol's name, its methods and the
operation each serves, and its table from domain errors to status codes); every call
names its front end, so the metrics and the log say which protocol answered it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from tokembed.server.core import deadlines
from tokembed.server.core.dtypes import DType
from tokembed.server.core.errors import (
    Cancelled,
    DeadlineExceeded,
    EmbedError,
    Internal,
    InvalidInput,
    ModelNotFound,
    Overloaded,
    TooLarge,
    Unauthenticated,
    Unavailable,
)
from tokembed.server.core.types import Timings

# The calls' log keeps the name it has always had (log filters and dashboards use it).
logger = logging.getLogger("tokembed.server.servicer")


@dataclass(frozen=True)
class FrontEnd:
    """A protocol's front end, as the metrics and logs see it."""

    protocol: str  # "tokembed.v1"
    methods: Mapping[str, str]  # each method's operation: "Embed" -> "embed"
    status_of: Callable[[EmbedError], str]  # its status code's name for a domain error
    ok: str = "OK"  # the status code of a served call


@dataclass(frozen=True)
class Outcomes:
    """How a call of one operation can end, by whether it had reached a model (routing
    names the call's model): the metrics start these series at 0, and no others, since a
    series that can never move is noise on a dashboard."""

    without_model: tuple[type[EmbedError], ...]  # refused before routing
    with_model: tuple[type[EmbedError], ...]  # refused once routed
    ok_with_model: bool = True  # False: answered without naming a model (a listing)


_BEFORE_ROUTING = (InvalidInput, TooLarge, ModelNotFound, Unavailable, Unauthenticated)
# What a served operation's calls may end with (embed's; the text operations' the same: a
# model without a tokenizer is an InvalidInput).
_SERVED = Outcomes(
    _BEFORE_ROUTING,
    (InvalidInput, TooLarge, Overloaded, DeadlineExceeded, Cancelled, Unavailable, Internal),
)
OUTCOMES: dict[str, Outcomes] = {
    "embed": _SERVED,
    # The way back: refused, overloaded or failed as embed is (one batcher, one admission).
    "nearest": _SERVED,
    "tokenize": _SERVED,
    "detokenize": _SERVED,
    "embed_text": _SERVED,
    "model_info": Outcomes((InvalidInput, ModelNotFound, Unavailable, Unauthenticated), ()),
    "list_models": Outcomes((InvalidInput, Unavailable, Unauthenticated), (), ok_with_model=False),
}


class Call:
    """One call (or one item of a stream) being served: what its outcome is told with."""

    __slots__ = ("_operation", "front_end", "method", "model", "request_id", "started", "version")

    def __init__(
        self, front_end: FrontEnd, method: str, request_id: str, operation: str = ""
    ) -> None:
        self.started = time.perf_counter()
        self.front_end = front_end
        self.method = method
        self.model = ""  # the model that answers it, once known
        self.version = ""  # and its version
        self.request_id = request_id
        # The operation that serves it, when its method serves more than one (V2's
        # ModelInfer: ids, texts, or vectors on a model's ``.nearest`` name); else its
        # method's.
        self._operation = operation

    @property
    def operation(self) -> str:
        return self._operation or self.front_end.methods.get(self.method, "")


@dataclass(slots=True)
class Delivered:
    """What a served call answered (not its rows: those are in the framed answer)."""

    shape: tuple[int, ...]
    dtype: DType
    tokens: int
    nbytes: int
    timings: Timings
    encode_s: float | None  # None: framed as it is sent (slices)


@dataclass
class ModelTotals:
    """A model's embed calls and batches, summed since start (every protocol and version):
    what the Open Inference Protocol's ModelStatistics reports. The metrics keep them,
    beside their series, from what the calls and the batches report."""

    success_count: int = 0
    success_s: float = 0.0
    fail_count: int = 0  # refused or failed once routed to the model
    fail_s: float = 0.0
    queue_count: int = 0
    queue_s: float = 0.0
    batches: int = 0
    compute_s: float = 0.0
    last_served_unix_s: float = 0.0  # 0: none yet


class CallsObserver(Protocol):
    """What the calls report (the metrics implement it)."""

    def call_done(
        self, protocol: str, operation: str, method: str, code: str, model: str,
        duration_s: float, version: str = "",
    ) -> None: ...  # fmt: skip

    def call_served(
        self, protocol: str, operation: str, method: str, code: str, model: str,
        duration_s: float,
        tokens: int, output_bytes: int, queue_s: float, encode_s: float | None,
        version: str = "",
    ) -> None: ...  # fmt: skip

    def rejected(self, reason: str) -> None: ...


# How often repeated refusals of one reason are summed up in the log, by default.
SUMMARY_INTERVAL_S = 10.0


class Calls:
    def __init__(
        self, observer: CallsObserver | None, *, summary_interval_s: float = SUMMARY_INTERVAL_S
    ) -> None:
        self._observer = observer
        self.active = 0  # calls (and stream items) being served now
        self.last_call_at = 0.0  # time.monotonic() of the latest call to reach a handler
        self._idle: asyncio.Event | None = None
        self._refusals = _RefusalLog(summary_interval_s)

    # --- in flight

    def start(
        self, front_end: FrontEnd, method: str, request_id: str = "", operation: str = ""
    ) -> Call:
        """A call reached its handler: it is in flight until ``end`` (``operation``: the
        one serving it, where its method serves several)."""
        self.active += 1
        self.last_call_at = time.monotonic()
        return Call(front_end, method, request_id, operation)

    def end(self) -> None:
        self.active -= 1
        if self.active == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call is in flight; False if ``timeout_s`` passed first."""
        if self.active == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=timeout_s)
        except TimeoutError:
            return False
        return True

    async def wait_quiet(self, quiet_s: float, since: float, until: float) -> None:
        """Wait until no call has reached a handler for ``quiet_s`` (counting from
        ``since`` at the earliest), or until ``until``."""
        while (now := time.monotonic()) < until:
            idle = now - max(self.last_call_at, since)
            if idle >= quiet_s:
                return
            await asyncio.sleep(min(quiet_s - idle, until - now))

    # --- outcomes

    def served(self, call: Call, delivered: Delivered) -> None:
        """A call answered with a tensor."""
        duration_s = time.perf_counter() - call.started
        if self._observer is not None:
            self._observer.call_served(
                call.front_end.protocol, call.operation, call.method, call.front_end.ok,
                call.model, duration_s, delivered.tokens, delivered.nbytes,
                delivered.timings.queue_s, delivered.encode_s, version=call.version,
            )  # fmt: skip
        if logger.isEnabledFor(logging.DEBUG):
            timings = delivered.timings
            logger.debug(
                "%s ok shape=%s dtype=%s model=%r queue=%.6fs compute=%.6fs batch=%d/%d "
                "total=%.6fs%s",
                call.method, list(delivered.shape), delivered.dtype.name, call.model,
                timings.queue_s, timings.compute_s, timings.batch_requests,
                timings.batch_tokens, duration_s, _request_id(call),
                extra={"method": call.method, "model": call.model, "code": call.front_end.ok,
                       "protocol": call.front_end.protocol, "request_id": call.request_id},
            )  # fmt: skip

    def answered(self, call: Call) -> None:
        """A call with no tensor in its answer (model info, listings) ended OK."""
        if self._observer is not None:
            self._observer.call_done(
                call.front_end.protocol, call.operation, call.method, call.front_end.ok,
                call.model, time.perf_counter() - call.started, version=call.version,
            )  # fmt: skip

    def refused(self, call: Call, error: EmbedError) -> None:
        code = call.front_end.status_of(error)
        if self._observer is not None:
            self._observer.call_done(
                call.front_end.protocol, call.operation, call.method, code, call.model,
                time.perf_counter() - call.started, version=call.version,
            )  # fmt: skip
            self._observer.rejected(error.reason)
        level = self._refusals.level(error.reason)
        if logger.isEnabledFor(level):
            logger.log(
                level, "%s rejected (%s, %s): %s%s", call.method, error.reason, code, error,
                _request_id(call),
                extra={"method": call.method, "model": call.model, "reason": error.reason,
                       "code": code, "protocol": call.front_end.protocol,
                       "request_id": call.request_id},
            )  # fmt: skip

    def flush(self) -> None:
        """Log the refusals not yet summed up (the server is stopping)."""
        self._refusals.flush()

    def gone(self, call: Call, deadline: float | None) -> None:
        """The call's handler was cancelled: its caller went away, or its deadline passed.

        Which one is ``deadlines.departure``'s to say, as it is for the batcher's drops.
        """
        self.refused(call, deadlines.departure(deadline, time.monotonic()))


class _RefusalLog:
    """Which refusals are logged in full: per reason, the first of each interval; the
    others are counted and summed up in one line when the interval ends."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._windows: dict[str, _Window] = {}  # open intervals, by reason

    def level(self, reason: str) -> int:
        """The level of this refusal's own line: WARNING for the first of an interval."""
        window = self._windows.get(reason)
        if window is not None:
            window.more += 1
            return logging.DEBUG
        window = self._windows[reason] = _Window(time.monotonic())
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test, a thread): summed up at the next flush
            return logging.WARNING
        window.timer = loop.call_later(self._interval_s, self._close, reason)
        return logging.WARNING

    def flush(self) -> None:
        for reason in list(self._windows):
            self._close(reason)

    def _close(self, reason: str) -> None:
        window = self._windows.pop(reason, None)
        if window is None:
            return
        if window.timer is not None:
            window.timer.cancel()
        if window.more:
            logger.warning(
                "%d more rejected (%s) in the last %.0f s", window.more, reason,
                time.monotonic() - window.opened,
                extra={"reason": reason, "count": window.more},
            )  # fmt: skip


class _Window:
    __slots__ = ("more", "opened", "timer")

    def __init__(self, opened: float) -> None:
        self.opened = opened
        self.more = 0
        self.timer: asyncio.TimerHandle | None = None


def _request_id(call: Call) -> str:
    """The caller's request id, as the log lines echo it (the proto promises so)."""
    return f" request_id={call.request_id!r}" if call.request_id else ""
