"""How each RPC ended, told to the metrics (when there are any) and to the log."""

from __future__ import annotations

import logging
import time

import grpc

from tokembed.server.domain import EmbedOutput, Timings
from tokembed.server.metrics import Metrics

# The RPCs' log keeps the name it has always had (log filters and dashboards use it).
logger = logging.getLogger("tokembed.server.servicer")


class RpcOutcomes:
    def __init__(self, metrics: Metrics | None) -> None:
        self._metrics = metrics

    def done(self, method: str, code: grpc.StatusCode, started: float) -> None:
        """An RPC ended with ``code`` (no answer to count)."""
        if self._metrics is not None:
            self._metrics.rpc_done(method, code.name, time.perf_counter() - started)

    def served(
        self, method: str, output: EmbedOutput, started: float, encode_s: float | None
    ) -> None:
        """An answer served; ``encode_s``: its encode time (None: chunks, not encoded as
        one message)."""
        array = output.hidden_states
        if self._metrics is not None:
            tokens = sum(output.lengths) if output.lengths else array.size // array.shape[-1]
            self._metrics.served(
                method, time.perf_counter() - started, tokens, array.nbytes,
                output.timings.queue_s, encode_s,
            )  # fmt: skip
        if logger.isEnabledFor(logging.DEBUG):
            self._log_served(method, array.shape, str(array.dtype), output.timings, started)

    def served_plain(
        self,
        method: str,
        shape: tuple[int, int, int],
        timings: Timings,
        started: float,
        encode_s: float,
    ) -> None:
        """:meth:`served` for a plain answer (float32 rows ``shape``, never an array)."""
        batch, seq_len, d_model = shape
        if self._metrics is not None:
            tokens = batch * seq_len
            self._metrics.served(
                method, time.perf_counter() - started, tokens, tokens * d_model * 4,
                timings.queue_s, encode_s,
            )  # fmt: skip
        if logger.isEnabledFor(logging.DEBUG):
            self._log_served(method, shape, "float32", timings, started)

    def rejected(
        self, method: str, reason: str, code: grpc.StatusCode, started: float, message: str = ""
    ) -> None:
        self.done(method, code, started)
        if self._metrics is not None:
            self._metrics.rejected(reason)
        logger.warning(
            "%s rejected (%s, %s): %s", method, reason, code.name, message,
            extra={"method": method, "reason": reason, "code": code.name},
        )  # fmt: skip

    def _log_served(
        self, method: str, shape: tuple[int, ...], dtype: str, timings: Timings, started: float
    ) -> None:
        logger.debug(
            "%s ok shape=%s dtype=%s queue=%.6fs compute=%.6fs batch=%d/%d total=%.6fs",
            method, list(shape), dtype, timings.queue_s, timings.compute_s,
            timings.batch_requests, timings.batch_tokens, time.perf_counter() - started,
            extra={"method": method, "code": "OK"},
        )  # fmt: skip
