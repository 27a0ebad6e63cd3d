"""Every Prometheus metric of the server, in one place.

Prefix ``tokembed_``, base units in the names. Metrics live on a registry that is passed
in, never the global one, so tests and several servers in one process do not collide.
docs/metrics.md documents each one (type, labels, meaning); keep the two in step.
"""

from __future__ import annotations

import collections
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app
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
# the gRPC status codes the server answers with (edge/status_codes.py's table, plus OK).
RPC_METHODS = ("Embed", "EmbedStream", "EmbedChunked", "GetModelInfo", "ListModels")
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
    backend: str


class _ModelSeries:
    """The series of one model that every served request or batch updates, looked up
    once (resolving a labelled series costs more than updating it)."""

    __slots__ = ("batch_requests", "batch_tokens", "batches", "compute", "encode",
                 "output_bytes", "queue_wait", "tokens")  # fmt: skip

    def __init__(self, metrics: Metrics, model: str) -> None:
        self.queue_wait = metrics.queue_wait.labels(model)
        self.compute = metrics.compute.labels(model)
        self.encode = metrics.encode.labels(model)
        self.batch_requests = metrics.batch_requests.labels(model)
        self.batch_tokens = metrics.batch_tokens.labels(model)
        self.batches = metrics.batches.labels(model)
        self.tokens = metrics.tokens.labels(model)
        self.output_bytes = metrics.output_bytes.labels(model)


class Metrics:
    def __init__(self, registry: CollectorRegistry, *, process_collector: bool = True) -> None:
        self.registry = registry
        # First: collections apply what is pending before reading any metric.
        self._pending = PendingUpdates()
        registry.register(self._pending)
        # Resolving a labelled series costs more than updating it: keep them, per
        # (method, code, model) as (requests, request_duration), and per model.
        self._rpc_series: dict[tuple[str, str, str], tuple[CounterSeries, HistogramSeries]] = {}
        self._model_series: dict[str, _ModelSeries] = {}
        # The series every served request updates: plain numbers (see request_metrics),
        # exposed by one collector, read under the lock their updates are applied under.
        self.requests = CounterFamily(
            "tokembed_requests",
            "RPCs finished, by method, gRPC status code and model (EmbedStream: one per request)",
            ["method", "code", "model"],
        )
        self.request_duration = HistogramFamily(
            "tokembed_request_duration_seconds",
            "Server time of an RPC, from decoding the request to handing the answer to gRPC",
            LATENCY_BUCKETS_S,
            ["method", "model"],
        )
        self.queue_wait = HistogramFamily(
            "tokembed_queue_wait_seconds",
            "Time a served request waited in the batcher before its batch's look-up started",
            LATENCY_BUCKETS_S,
            ["model"],
        )
        self.compute = HistogramFamily(
            "tokembed_compute_seconds",
            "Look-up time of one batch: the rows sliced from a table, or an onnxruntime run",
            LATENCY_BUCKETS_S,
            ["model"],
        )
        self.encode = HistogramFamily(
            "tokembed_encode_seconds",
            "Time to encode one response's bytes (Embed and EmbedStream answers)",
            LATENCY_BUCKETS_S,
            ["model"],
        )
        self.batch_requests = HistogramFamily(
            "tokembed_batch_requests", "Requests per batch", BATCH_REQUESTS_BUCKETS, ["model"]
        )
        self.batch_tokens = HistogramFamily(
            "tokembed_batch_tokens", "Tokens per batch", BATCH_TOKENS_BUCKETS, ["model"]
        )
        self.batches = CounterFamily("tokembed_batches", "Batches computed", ["model"])
        self.tokens = CounterFamily("tokembed_tokens", "Tokens embedded", ["model"])
        self.output_bytes = CounterFamily(
            "tokembed_output_bytes", "Bytes of hidden_states returned", ["model"]
        )
        families = (
            self.requests, self.request_duration, self.queue_wait, self.compute,
            self.encode, self.batch_requests, self.batch_tokens, self.batches, self.tokens,
            self.output_bytes,
        )  # fmt: skip
        registry.register(
            RequestMetricsCollector(families, self._pending.lock, self._pending.apply)
        )
        self.inflight = Gauge(
            "tokembed_inflight_requests", "RPCs being served now", registry=registry
        )
        self.queued_tokens = Gauge(
            "tokembed_queued_tokens",
            "Tokens waiting in a model's batcher for a batch",
            ["model"],
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
            "Queued requests dropped before compute, by model and reason",
            ["model", "reason"],
            registry=registry,
        )
        self.model_info = Gauge(
            "tokembed_model_info",
            "A served model (value 1)",
            ["name", "version", "vocab_size", "d_model", "dtype", "execution_provider",
             "backend"],
            registry=registry,
        )  # fmt: skip
        self.ready = Gauge(
            "tokembed_ready",
            "1 when every model is loaded and warmed and the server is not draining",
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
        # (go-grpc-prometheus's InitializeMetrics does the same.) Those of each model
        # start when it is added; model "" counts requests that name no served model.
        self._start_rpc_series("")
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason=reason)

    def _start_rpc_series(self, model: str) -> None:
        for method in RPC_METHODS:
            self.request_duration.labels(method, model)
            for code in RPC_CODES:
                self.requests.labels(method, code, model)

    # --- the request path: deferred updates (see PendingUpdates)

    # One pending update per call, applied later as several series updates: the request
    # path pays one append, whatever the number of series.

    def rpc_done(self, method: str, model: str, code: str, duration_s: float) -> None:
        self._pending.add(self._apply_rpc_done, (method, code, model, duration_s))

    def served(
        self,
        method: str,
        model: str,
        duration_s: float,
        tokens: int,
        output_bytes: int,
        queue_s: float,
        encode_s: float | None,
    ) -> None:
        """An RPC (or one EmbedStream answer) served OK: its count and duration, what it
        answered, and how long its encode took (None: not encoded as one message)."""
        self._pending.add(
            self._apply_served,
            (method, model, duration_s, tokens, output_bytes, queue_s, encode_s),
        )

    def rejected(self, reason: str) -> None:
        self._pending.add(self.rejections.labels(reason=reason).inc, 1)

    # --- the engines' observer

    def batch_done(self, model: str, requests: int, tokens: int, compute_s: float) -> None:
        self._pending.add(self._apply_batch_done, (model, requests, tokens, compute_s))

    def dropped(self, model: str, reason: str) -> None:
        # Rejections are counted once, at the RPC edge; this counts the look-ups saved.
        self.batcher_dropped.labels(model=model, reason=reason).inc()

    # --- applied by PendingUpdates.apply, under its lock

    def _apply_rpc_done(self, update: tuple[str, str, str, float]) -> None:
        method, code, model, duration_s = update
        series = self._rpc_series.get((method, code, model))
        if series is None:
            series = (
                self.requests.labels(method, code, model),
                self.request_duration.labels(method, model),
            )
            self._rpc_series[(method, code, model)] = series
        series[0].inc(1)
        series[1].observe(duration_s)

    def _apply_served(self, update: tuple[str, str, float, int, int, float, float | None]) -> None:
        method, model, duration_s, tokens, output_bytes, queue_s, encode_s = update
        self._apply_rpc_done((method, "OK", model, duration_s))
        series = self._series(model)
        series.tokens.inc(tokens)
        series.output_bytes.inc(output_bytes)
        series.queue_wait.observe(queue_s)
        if encode_s is not None:
            series.encode.observe(encode_s)

    def _apply_batch_done(self, update: tuple[str, int, int, float]) -> None:
        model, requests, tokens, compute_s = update
        series = self._series(model)
        series.batches.inc(1)
        series.batch_requests.observe(requests)
        series.batch_tokens.observe(tokens)
        series.compute.observe(compute_s)

    def _series(self, model: str) -> _ModelSeries:
        series = self._model_series.get(model)
        if series is None:
            series = self._model_series[model] = _ModelSeries(self, model)
        return series

    # --- wiring

    def add_model(self, labels: ModelLabels, queued_tokens: Callable[[], int]) -> None:
        """A model is served: its info series, its queue gauge, its series at 0."""
        self.model_info.labels(
            name=labels.name,
            version=labels.version,
            vocab_size=str(labels.vocab_size),
            d_model=str(labels.d_model),
            dtype=labels.dtype,
            execution_provider=labels.execution_provider,
            backend=labels.backend,
        ).set(1)
        self.queued_tokens.labels(model=labels.name).set_function(lambda: float(queued_tokens()))
        # Under the lock: a scrape may be reading the families meanwhile.
        with self._pending.lock:
            self._start_rpc_series(labels.name)
            self._series(labels.name)

    def track_inflight(self, active_requests: Callable[[], int]) -> None:
        # Read at scrape time: no update at all on the request path.
        self.inflight.set_function(lambda: float(active_requests()))


# How often the /metrics thread looks for a stop request: prometheus_client's own
# start_http_server polls every 0.5 s, which every drain (and every test's server stop)
# then waited for.
METRICS_STOP_POLL_S = 0.05


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not news: log none of them."""


def start_metrics_server(
    registry: CollectorRegistry, host: str, port: int
) -> tuple[Callable[[], None], int]:
    """Serve ``/metrics`` on its own port; return (stop, bound port). As
    prometheus_client's start_http_server, but stopped within METRICS_STOP_POLL_S."""
    family, *_, where = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    class Server(ThreadingWSGIServer):
        address_family = family  # IPv6 hosts too

    httpd = make_server(
        str(where[0]), port, make_wsgi_app(registry), Server, handler_class=_QuietHandler
    )
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": METRICS_STOP_POLL_S},
        name="tokembed-metrics", daemon=True,
    )  # fmt: skip
    thread.start()

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        if thread is not threading.current_thread():
            thread.join(timeout=5)

    return stop, int(httpd.server_port)
