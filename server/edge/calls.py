"""The RPCs' bookkeeping: how many are in flight (the drain waits for them), when the
last one came, and how each ended, told to the metrics and the log from here alone."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc

from tokembed.server.core.engine import Served
from tokembed.server.metrics import Metrics

# The RPCs' log keeps the name it has always had (log filters and dashboards use it).
logger = logging.getLogger("tokembed.server.servicer")


class Call:
    """One RPC (or one EmbedStream request) being served: what its outcome is told with."""

    __slots__ = ("method", "model", "request_id", "started")

    def __init__(self, method: str, request_id: str) -> None:
        self.started = time.perf_counter()
        self.method = method
        self.model = ""  # the model that answers it, once known
        self.request_id = request_id


class Calls:
    def __init__(self, metrics: Metrics | None) -> None:
        self._metrics = metrics
        self.active = 0  # RPCs (and EmbedStream requests) being served now
        self.last_call_at = 0.0  # time.monotonic() of the latest call to reach a handler
        self._idle: asyncio.Event | None = None

    # --- in flight

    def start(self, method: str, request_id: str = "") -> Call:
        """A call reached its handler: it is in flight until ``end``."""
        self.active += 1
        self.last_call_at = time.monotonic()
        return Call(method, request_id)

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

    def served(self, call: Call, served: Served[Any], encode_s: float | None) -> None:
        """An answer served; ``encode_s``: its encode time (None: chunks, made as they
        are sent)."""
        duration_s = time.perf_counter() - call.started
        if self._metrics is not None:
            self._metrics.served(
                call.method, call.model, duration_s, served.tokens, served.nbytes,
                served.timings.queue_s, encode_s,
            )  # fmt: skip
        if logger.isEnabledFor(logging.DEBUG):
            timings = served.timings
            logger.debug(
                "%s ok shape=%s dtype=%s model=%s queue=%.6fs compute=%.6fs batch=%d/%d "
                "total=%.6fs%s",
                call.method, list(served.shape), served.dtype.name, call.model,
                timings.queue_s, timings.compute_s, timings.batch_requests,
                timings.batch_tokens, duration_s, _request_id(call),
                extra={"method": call.method, "model": call.model, "code": "OK",
                       "request_id": call.request_id},
            )  # fmt: skip

    def answered(self, call: Call) -> None:
        """An RPC with no embedding in its answer (GetModelInfo, ListModels) ended OK."""
        if self._metrics is not None:
            self._metrics.rpc_done(
                call.method, call.model, "OK", time.perf_counter() - call.started
            )

    def refused(self, call: Call, reason: str, code: grpc.StatusCode, message: str) -> None:
        if self._metrics is not None:
            self._metrics.rpc_done(
                call.method, call.model, code.name, time.perf_counter() - call.started
            )
            self._metrics.rejected(reason)
        logger.warning(
            "%s rejected (%s, %s): %s%s", call.method, reason, code.name, message,
            _request_id(call),
            extra={"method": call.method, "model": call.model, "reason": reason,
                   "code": code.name, "request_id": call.request_id},
        )  # fmt: skip


def _request_id(call: Call) -> str:
    """The caller's request id, as the log lines echo it (the proto promises so)."""
    return f" request_id={call.request_id}" if call.request_id else ""
