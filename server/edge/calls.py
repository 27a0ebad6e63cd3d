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


class Calls:
    def __init__(self, metrics: Metrics | None) -> None:
        self._metrics = metrics
        self.active = 0  # RPCs (and EmbedStream requests) being served now
        self.last_call_at = 0.0  # time.monotonic() of the latest call to reach a handler
        self._idle: asyncio.Event | None = None

    # --- in flight

    def enter(self) -> None:
        self.active += 1
        self.last_call_at = time.monotonic()

    def leave(self) -> None:
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

    def served(
        self, method: str, model: str, started: float, answer: Served[Any],
        encode_s: float | None,
    ) -> None:  # fmt: skip
        """An answer served (an RPC, or one EmbedStream request); ``encode_s``: its
        encode time (None: chunks, made as they are sent)."""
        if self._metrics is not None:
            self._metrics.served(
                method, model, time.perf_counter() - started, answer.tokens, answer.nbytes,
                answer.timings.queue_s, encode_s,
            )  # fmt: skip
        if logger.isEnabledFor(logging.DEBUG):
            timings = answer.timings
            logger.debug(
                "%s ok shape=%s dtype=%s model=%s queue=%.6fs compute=%.6fs batch=%d/%d "
                "total=%.6fs",
                method, list(answer.shape), answer.dtype.name, model, timings.queue_s,
                timings.compute_s, timings.batch_requests, timings.batch_tokens,
                time.perf_counter() - started,
                extra={"method": method, "model": model, "code": "OK"},
            )  # fmt: skip

    def answered(self, method: str, model: str, started: float) -> None:
        """An RPC with no embedding in its answer (GetModelInfo, ListModels) ended OK."""
        if self._metrics is not None:
            self._metrics.rpc_done(method, model, "OK", time.perf_counter() - started)

    def refused(
        self,
        method: str,
        model: str,
        reason: str,
        code: grpc.StatusCode,
        started: float,
        message: str,
    ) -> None:
        if self._metrics is not None:
            self._metrics.rpc_done(method, model, code.name, time.perf_counter() - started)
            self._metrics.rejected(reason)
        logger.warning(
            "%s rejected (%s, %s): %s", method, reason, code.name, message,
            extra={"method": method, "model": model, "reason": reason, "code": code.name},
        )  # fmt: skip
