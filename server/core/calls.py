"""The calls' bookkeeping: how many are in flight (the drain waits for them), when the last
one came, and how each ended, told to the metrics and the log from here alone, whatever
the protocol.

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

from tokembed.server.core.dtypes import DType
from tokembed.server.core.errors import (
    Cancelled,
    DeadlineExceeded,
    EmbedError,
    ran_out_of_time,
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
    # The status codes its table can give (and ``ok``): the metrics' series start at 0.
    codes: tuple[str, ...] = ()


class Call:
    """One call (or one item of a stream) being served: what its outcome is told with."""

    __slots__ = ("front_end", "method", "model", "request_id", "started")

    def __init__(self, front_end: FrontEnd, method: str, request_id: str) -> None:
        self.started = time.perf_counter()
        self.front_end = front_end
        self.method = method
        self.model = ""  # the model that answers it, once known
        self.request_id = request_id

    @property
    def operation(self) -> str:
        return self.front_end.methods.get(self.method, "")


@dataclass(slots=True)
class Delivered:
    """What a served call answered (not its rows: those are in the framed answer)."""

    shape: tuple[int, ...]
    dtype: DType
    tokens: int
    nbytes: int
    timings: Timings
    encode_s: float | None  # None: framed as it is sent (slices)


class CallsObserver(Protocol):
    """What the calls report (the metrics implement it)."""

    def call_done(
        self, protocol: str, operation: str, method: str, code: str, model: str, duration_s: float
    ) -> None: ...

    def call_served(
        self, protocol: str, operation: str, method: str, model: str, duration_s: float,
        tokens: int, output_bytes: int, queue_s: float, encode_s: float | None,
    ) -> None: ...  # fmt: skip

    def rejected(self, reason: str) -> None: ...


class Calls:
    def __init__(self, observer: CallsObserver | None) -> None:
        self._observer = observer
        self.active = 0  # calls (and stream items) being served now
        self.last_call_at = 0.0  # time.monotonic() of the latest call to reach a handler
        self._idle: asyncio.Event | None = None

    # --- in flight

    def start(self, front_end: FrontEnd, method: str, request_id: str = "") -> Call:
        """A call reached its handler: it is in flight until ``end``."""
        self.active += 1
        self.last_call_at = time.monotonic()
        return Call(front_end, method, request_id)

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
                call.front_end.protocol, call.operation, call.method, call.model, duration_s,
                delivered.tokens, delivered.nbytes, delivered.timings.queue_s,
                delivered.encode_s,
            )  # fmt: skip
        if logger.isEnabledFor(logging.DEBUG):
            timings = delivered.timings
            logger.debug(
                "%s ok shape=%s dtype=%s model=%s queue=%.6fs compute=%.6fs batch=%d/%d "
                "total=%.6fs%s",
                call.method, list(delivered.shape), delivered.dtype.name, call.model,
                timings.queue_s, timings.compute_s, timings.batch_requests,
                timings.batch_tokens, duration_s, _request_id(call),
                extra={"method": call.method, "model": call.model, "code": "OK",
                       "protocol": call.front_end.protocol, "request_id": call.request_id},
            )  # fmt: skip

    def answered(self, call: Call) -> None:
        """A call with no tensor in its answer (model info, listings) ended OK."""
        if self._observer is not None:
            self._observer.call_done(
                call.front_end.protocol, call.operation, call.method, call.front_end.ok,
                call.model, time.perf_counter() - call.started,
            )  # fmt: skip

    def refused(self, call: Call, error: EmbedError) -> None:
        code = call.front_end.status_of(error)
        if self._observer is not None:
            self._observer.call_done(
                call.front_end.protocol, call.operation, call.method, code, call.model,
                time.perf_counter() - call.started,
            )  # fmt: skip
            self._observer.rejected(error.reason)
        logger.warning(
            "%s rejected (%s, %s): %s%s", call.method, error.reason, code, error,
            _request_id(call),
            extra={"method": call.method, "model": call.model, "reason": error.reason,
                   "code": code, "protocol": call.front_end.protocol,
                   "request_id": call.request_id},
        )  # fmt: skip

    def gone(self, call: Call, deadline: float | None) -> None:
        """The call's handler was cancelled: its caller went away, or its deadline passed.

        The transport cancels the handler in both cases; only the time left tells them
        apart, by the same rule as the batcher's drops (``errors.ran_out_of_time``).
        """
        if ran_out_of_time(deadline, time.monotonic()):
            self.refused(call, DeadlineExceeded("deadline passed"))
        else:
            self.refused(call, Cancelled("caller left"))


def _request_id(call: Call) -> str:
    """The caller's request id, as the log lines echo it (the proto promises so)."""
    return f" request_id={call.request_id}" if call.request_id else ""
