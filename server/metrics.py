"""Every Prometheus metric of the server, in one place.

Prefix ``tokembed_``, base units in the names. Metrics live on a registry that is passed
in, never the global one, so tests and several servers in one process do not collide.
docs/metrics.md documents each one (type, labels, meaning); keep the two in step.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from tokembed.server.request_metrics import (
    CounterFamily,
    CounterSeries,
    HistogramFamily,
    HistogramSeries,
    RequestMetricsCollector,
)

# Sub-millisecond resolution: a tiny look-up is ~10 µs and a round trip ~0.6 ms here.
LATENCY_BUCKETS_S = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
BATCH_REQUESTS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BATCH_TOKENS_BUCKETS = (1, 8, 32, 128, 512, 2048, 8192, 16384, 32768, 65536, 262144)

# The RPCs of tokembed.v1.EmbeddingService, as they appear in the `method` label, and
# the gRPC status codes the server answers with (status.py's table, plus OK).
RPC_METHODS = ("Embed", "EmbedStream", "EmbedChunked", "GetModelInfo")
RPC_CODES = (
    "OK", "CANCELLED", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "RESOURCE_EXHAUSTED", "INTERNAL", "UNAVAILABLE",
)  # fmt: skip

# Reasons a request is refused or dropped, as they appear in tokembed_rejections_total.
REJECTION_REASONS = (
    "overloaded", "invalid_input", "too_large", "deadline_exceeded", "cancelled",
    "not_found", "unavailable", "unauthenticated", "internal",
)  # fmt: skip


class PendingUpdates(Collector):
    """Metric updates made on the request path, applied to the metrics in bulk.

    Why: every prometheus_client update takes a lock and runs a little Python, and one
    tiny request makes a dozen of them: ~25 us of a ~0.8 ms round trip, measured in the
    running server (far more than the same calls cost in a hot loop). Appending to a
    deque is lock-free and thread-safe under the GIL (~0.1 us). (The series a served
    request updates are moreover plain numbers, see request_metrics.) The updates are applied
    before every collection (a scrape, or a test reading the registry: this collector is
    registered before the metrics, and the registry collects in registration order), and
    on the recording thread whenever ``apply_every`` have piled up, so memory stays
    bounded when nobody scrapes. Nothing is lost: each update is popped exactly once,
    by the one thread applying (tests/metrics/test_pending_updates.py).
    """

    def __init__(self, apply_every: int = 1024) -> None:
        # (update, its argument): update(argument) is called when applied.
        self._updates: collections.deque[tuple[Callable[[Any], None], Any]] = collections.deque()
        self._apply_every = apply_every
        # One thread applies at a time, so that a collection waits for an apply already
        # under way and then sees its updates; adding never takes it.
        self._applying = threading.Lock()

    def add(self, update: Callable[[Any], None], value: Any) -> None:
        self._updates.append((update, value))
        if len(self._updates) >= self._apply_every:
            self.apply()

    def apply(self) -> None:
        updates = self._updates
        with self._applying:
            for _ in range(len(updates)):
                update, value = updates.popleft()
                update(value)

    def collect(self) -> Iterator[Metric]:
        self.apply()
        return iter(())

    @property
    def lock(self) -> threading.Lock:
        """Held while updates are applied: whoever reads what they change holds it too."""
        return self._applying


@dataclass(frozen=True)
class ModelLabels:
    name: str
    version: str
    vocab_size: int
    d_model: int
    dtype: str
    execution_provider: str


class Metrics:
    def __init__(self, registry: CollectorRegistry, *, process_collector: bool = True) -> None:
        self.registry = registry
        # First: collections apply what is pending before reading any metric.
        self._pending = PendingUpdates()
        registry.register(self._pending)
        # Resolving a labelled series costs more than updating it: keep them, per
        # (method, code), as (requests, request_duration).
        self._rpc_series: dict[tuple[str, str], tuple[CounterSeries, HistogramSeries]] = {}
        # The series every served request updates: plain numbers (see request_metrics),
        # exposed by one collector, read under the lock their updates are applied under.
        self.requests = CounterFamily(
            "tokembed_requests",
            "RPCs finished, by method and gRPC status code (EmbedStream: one per request)",
            ["method", "code"],
        )
        self.request_duration = HistogramFamily(
            "tokembed_request_duration_seconds",
            "Server time of an RPC, from decoding the request to handing the answer to gRPC",
            LATENCY_BUCKETS_S,
            ["method"],
        )
        self.queue_wait = HistogramFamily(
            "tokembed_queue_wait_seconds",
            "Time a served request waited in the batcher before its batch's look-up started",
            LATENCY_BUCKETS_S,
        )
        self.compute = HistogramFamily(
            "tokembed_compute_seconds",
            "Look-up time of one batch: the onnxruntime run, or the float32 table gather",
            LATENCY_BUCKETS_S,
        )
        self.encode = HistogramFamily(
            "tokembed_encode_seconds",
            "Time to encode one response's bytes (Embed and EmbedStream answers)",
            LATENCY_BUCKETS_S,
        )
        self.batch_requests = HistogramFamily(
            "tokembed_batch_requests", "Requests per batch", BATCH_REQUESTS_BUCKETS
        )
        self.batch_tokens = HistogramFamily(
            "tokembed_batch_tokens", "Tokens per batch", BATCH_TOKENS_BUCKETS
        )
        self.batches = CounterFamily("tokembed_batches", "Batches computed")
        self.tokens = CounterFamily("tokembed_tokens", "Tokens embedded")
        self.output_bytes = CounterFamily(
            "tokembed_output_bytes", "Bytes of hidden_states returned"
        )
        families = (
            self.requests, self.request_duration, self.queue_wait, self.compute,
            self.encode, self.batch_requests, self.batch_tokens, self.batches, self.tokens,
            self.output_bytes,
        )  # fmt: skip
        for family in families[2:]:
            family.labels()  # the unlabelled ones: their one series, at 0 from the start
        registry.register(
            RequestMetricsCollector(families, self._pending.lock, self._pending.apply)
        )
        # The one series of each unlabelled family, looked up once.
        self._queue_wait = self.queue_wait.labels()
        self._compute = self.compute.labels()
        self._encode = self.encode.labels()
        self._batch_requests = self.batch_requests.labels()
        self._batch_tokens = self.batch_tokens.labels()
        self._batches = self.batches.labels()
        self._tokens = self.tokens.labels()
        self._output_bytes = self.output_bytes.labels()
        self.inflight = Gauge(
            "tokembed_inflight_requests", "RPCs being served now", registry=registry
        )
        self.queued_tokens = Gauge(
            "tokembed_queued_tokens",
            "Tokens waiting in the batcher for a batch",
            registry=registry,
        )
        self.inflight_output_bytes = Gauge(
            "tokembed_inflight_output_bytes",
            "Output bytes of admitted requests not yet finished (admission control)",
            registry=registry,
        )
        self.rejections = Counter(
            "tokembed_rejections",
            "Requests refused or dropped, by reason",
            ["reason"],
            registry=registry,
        )
        self.batcher_dropped = Counter(
            "tokembed_batcher_dropped",
            "Queued requests dropped before compute, by reason",
            ["reason"],
            registry=registry,
        )
        self.model_info = Gauge(
            "tokembed_model_info",
            "The served model (value 1)",
            ["name", "version", "vocab_size", "d_model", "dtype", "execution_provider"],
            registry=registry,
        )
        self.ready = Gauge(
            "tokembed_ready",
            "1 when the model is loaded and warmed and not draining",
            registry=registry,
        )
        if process_collector:
            # CPU seconds, resident memory, open file descriptors (Linux /proc), plus the
            # interpreter's version and garbage collections, as the global registry has.
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
            GCCollector(registry=registry)
        # Series that exist from the start at 0, so that rate() and increase() count the
        # first events after a (re)start: a series born at 3 shows no increase at all.
        # (go-grpc-prometheus's InitializeMetrics does the same.)
        for method in RPC_METHODS:
            self.request_duration.labels(method)
            for code in RPC_CODES:
                self.requests.labels(method, code)
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason=reason)

    # --- the request path: deferred updates (see PendingUpdates)

    # One pending update per call, applied later as several series updates: the request
    # path pays one append, whatever the number of series.

    def rpc_done(self, method: str, code: str, duration_s: float) -> None:
        self._pending.add(self._apply_rpc_done, (method, code, duration_s))

    def served(
        self,
        method: str,
        duration_s: float,
        tokens: int,
        output_bytes: int,
        queue_s: float,
        encode_s: float | None,
    ) -> None:
        """An RPC (or one EmbedStream answer) served OK: its count and duration, what it
        answered, and how long its encode took (None: not encoded as one message)."""
        self._pending.add(
            self._apply_served, (method, duration_s, tokens, output_bytes, queue_s, encode_s)
        )

    def rejected(self, reason: str) -> None:
        self._pending.add(self.rejections.labels(reason=reason).inc, 1)

    # --- the batcher's observer

    def batch_done(self, requests: int, tokens: int, compute_s: float) -> None:
        self._pending.add(self._apply_batch_done, (requests, tokens, compute_s))

    # --- applied by PendingUpdates.apply, under its lock

    def _apply_rpc_done(self, update: tuple[str, str, float]) -> None:
        method, code, duration_s = update
        series = self._rpc_series.get((method, code))
        if series is None:
            series = (self.requests.labels(method, code), self.request_duration.labels(method))
            self._rpc_series[(method, code)] = series
        series[0].inc(1)
        series[1].observe(duration_s)

    def _apply_served(self, update: tuple[str, float, int, int, float, float | None]) -> None:
        method, duration_s, tokens, output_bytes, queue_s, encode_s = update
        self._apply_rpc_done((method, "OK", duration_s))
        self._tokens.inc(tokens)
        self._output_bytes.inc(output_bytes)
        self._queue_wait.observe(queue_s)
        if encode_s is not None:
            self._encode.observe(encode_s)

    def _apply_batch_done(self, update: tuple[int, int, float]) -> None:
        requests, tokens, compute_s = update
        self._batches.inc(1)
        self._batch_requests.observe(requests)
        self._batch_tokens.observe(tokens)
        self._compute.observe(compute_s)

    def dropped(self, reason: str) -> None:
        # Rejections are counted once, at the RPC edge; this counts the look-ups saved.
        self.batcher_dropped.labels(reason=reason).inc()

    # --- wiring

    def set_model(self, labels: ModelLabels) -> None:
        self.model_info.clear()
        self.model_info.labels(
            name=labels.name,
            version=labels.version,
            vocab_size=str(labels.vocab_size),
            d_model=str(labels.d_model),
            dtype=labels.dtype,
            execution_provider=labels.execution_provider,
        ).set(1)

    def track_queue(self, queued_tokens: Callable[[], int]) -> None:
        self.queued_tokens.set_function(lambda: float(queued_tokens()))

    def track_inflight(self, active_requests: Callable[[], int]) -> None:
        # Read at scrape time: no update at all on the request path.
        self.inflight.set_function(lambda: float(active_requests()))


def start_metrics_server(
    registry: CollectorRegistry, host: str, port: int
) -> tuple[Callable[[], None], int]:
    """Serve ``/metrics`` on its own port; return (stop, bound port)."""
    from prometheus_client import start_http_server

    httpd, thread = start_http_server(port, addr=host, registry=registry)

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        if thread is not threading.current_thread():
            thread.join(timeout=5)

    return stop, int(httpd.server_port)
