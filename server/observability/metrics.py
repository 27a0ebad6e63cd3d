"""The Prometheus metrics of the server: what the calls and batches update, and the
process's own. The series of what is served, read at each scrape: model_metrics.py;
``/metrics`` itself: metrics_http.py.

Prefix ``tokembed_``, base units in the names. Metrics live on a registry that is passed
in, never the global one, so tests and several servers in one process do not collide.
docs/metrics.md documents each one (type, labels, meaning); keep the two in step.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from tokembed.server.core.calls import OUTCOMES, FrontEnd, ModelTotals
from tokembed.server.core.control import IndexEntry
from tokembed.server.observability.model_metrics import (
    ModelLabels,
    ModelsCollector,
    ModelStatesCollector,
)
from tokembed.server.observability.request_metrics import (
    CounterFamily,
    CounterSeries,
    HistogramFamily,
    HistogramSeries,
    RequestMetricsCollector,
)

# Sub-millisecond resolution: a tiny look-up takes microseconds, a round trip less than a
# millisecond.
LOAD_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
LATENCY_BUCKETS_S = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
BATCH_REQUESTS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BATCH_TOKENS_BUCKETS = (1, 8, 32, 128, 512, 2048, 8192, 16384, 32768, 65536, 262144)

# Reasons a request is refused or dropped, as they appear in tokembed_rejections_total.
REJECTION_REASONS = (
    "overloaded", "invalid_input", "too_large", "deadline_exceeded", "cancelled",
    "not_found", "unavailable", "unauthenticated", "control_refused", "load_failed",
    "internal",
)  # fmt: skip


class PendingUpdates(Collector):
    """Metric updates made on the request path, applied to the metrics in bulk.

    Why: every prometheus_client update takes a lock and runs a little Python, and one
    tiny request makes a dozen of them: a measurable part of its round trip in the
    running server (far more than the same calls cost in a hot loop). Appending to a
    deque is lock-free, thread-safe under the GIL, and cheap. (The series a served
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
    """The server's metrics; it observes the calls (``core.calls``) and the schedulers."""

    def __init__(self, registry: CollectorRegistry, *, process_collector: bool = True) -> None:
        self.registry = registry
        # First: collections apply what is pending before reading any metric.
        self._pending = PendingUpdates()
        registry.register(self._pending)
        # Resolving a labelled series costs more than updating it: keep them, per
        # (protocol, operation, method, code, model) as (requests, request_duration), and
        # per model.
        self._call_series: dict[tuple[str, ...], tuple[CounterSeries, HistogramSeries]] = {}
        self._model_series: dict[str, _ModelSeries] = {}
        self._totals: dict[str, ModelTotals] = {}
        self._front_ends: list[FrontEnd] = []
        self._ok_codes: dict[str, str] = {}  # each front end's status of a served call
        # (model, version): ("", "") counts calls that reach no served model.
        self._models: list[tuple[str, str]] = [("", "")]
        # The series every served request updates: plain numbers (see request_metrics),
        # exposed by one collector, read under the lock their updates are applied under.
        self.requests = CounterFamily(
            "tokembed_requests",
            "Calls finished, by protocol, operation, method, status code, model and version "
            "(a stream: one per request)",
            ["protocol", "operation", "method", "code", "model", "version"],
        )
        self.request_duration = HistogramFamily(
            "tokembed_request_duration_seconds",
            "Server time of a call, from decoding the request to handing the answer to the "
            "transport",
            LATENCY_BUCKETS_S,
            ["protocol", "operation", "method", "model", "version"],
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
            "Time to frame one answer in its protocol's bytes (a chunked answer: its header)",
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
        self.rejections = CounterFamily(
            "tokembed_rejections", "Requests refused or dropped, by reason", ["reason"]
        )
        self.batcher_dropped = CounterFamily(
            "tokembed_batcher_dropped",
            "Queued requests dropped before compute, by model and reason",
            ["model", "reason"],
        )
        # The control plane's: loads and unloads of a model version, by outcome.
        self.model_loads = CounterFamily(
            "tokembed_model_loads",
            "Loads of a model version, by model, version and outcome (loaded, failed)",
            ["model", "version", "outcome"],
        )
        self.model_load_duration = HistogramFamily(
            "tokembed_model_load_duration_seconds",
            "Time to load and warm a model version (or to fail to), by model and outcome",
            LOAD_BUCKETS_S,
            ["model", "outcome"],
        )
        self.model_unloads = CounterFamily(
            "tokembed_model_unloads",
            "Unloads of a model version, by model, version and outcome (unloaded, failed)",
            ["model", "version", "outcome"],
        )
        self.model_unload_duration = HistogramFamily(
            "tokembed_model_unload_duration_seconds",
            "Time from an unload's start to the version let go (its last request answered)",
            LOAD_BUCKETS_S,
            ["model", "outcome"],
        )
        families = (
            self.requests, self.request_duration, self.queue_wait, self.compute,
            self.encode, self.batch_requests, self.batch_tokens, self.batches, self.tokens,
            self.output_bytes, self.rejections, self.batcher_dropped, self.model_loads,
            self.model_load_duration, self.model_unloads, self.model_unload_duration,
        )  # fmt: skip
        registry.register(
            RequestMetricsCollector(families, self._pending.lock, self._pending.apply)
        )
        self.inflight = Gauge(
            "tokembed_inflight_requests", "Calls being served now", registry=registry
        )
        self.inflight_output_bytes = Gauge(
            "tokembed_inflight_output_bytes",
            "Output bytes of admitted requests not yet finished (admission control)",
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
        # (go-grpc-prometheus's InitializeMetrics does the same.) Those of each front end
        # and each model start when they are added.
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason)

    def _start_call_series(self, front_end: FrontEnd, model: str, version: str) -> None:
        """The series of ``front_end``'s calls that can move for ``model`` and ``version``
        ("": calls that reached no model): those ``core.calls.OUTCOMES`` names, and no
        others."""
        protocol = front_end.protocol
        for method, operation in front_end.methods.items():
            outcomes = OUTCOMES[operation]
            errors = outcomes.with_model if model else outcomes.without_model
            codes = {front_end.status_of(error("")) for error in errors}
            if outcomes.ok_with_model == bool(model):
                codes.add(front_end.ok)
            if not codes:
                continue
            self.request_duration.labels(protocol, operation, method, model, version)
            for code in sorted(codes):
                self.requests.labels(protocol, operation, method, code, model, version)

    # --- the calls' observer: deferred updates (see PendingUpdates)

    # One pending update per call, applied later as several series updates: the request
    # path pays one append, whatever the number of series.

    def call_done(
        self,
        protocol: str,
        operation: str,
        method: str,
        code: str,
        model: str,
        duration_s: float,
        version: str = "",
    ) -> None:
        self._pending.add(
            self._apply_call_done, (protocol, operation, method, code, model, duration_s, version)
        )

    def call_served(
        self,
        protocol: str,
        operation: str,
        method: str,
        code: str,
        model: str,
        duration_s: float,
        tokens: int,
        output_bytes: int,
        queue_s: float,
        encode_s: float | None,
        version: str = "",
    ) -> None:
        """A call (or one stream answer) served OK: its count and duration, what it
        answered, and how long its frame took (None: not framed as one message)."""
        self._pending.add(
            self._apply_served,
            (protocol, operation, method, code, model, duration_s, tokens, output_bytes,
             queue_s, encode_s, time.time(), version),
        )  # fmt: skip

    def rejected(self, reason: str) -> None:
        self._pending.add(self.rejections.labels(reason).inc, 1)

    # --- the schedulers' observer

    def batch_done(self, model: str, requests: int, tokens: int, compute_s: float) -> None:
        self._pending.add(self._apply_batch_done, (model, requests, tokens, compute_s))

    def dropped(self, model: str, reason: str) -> None:
        # Rejections are counted once, with the call; this counts the look-ups saved.
        self._pending.add(self.batcher_dropped.labels(model, reason).inc, 1)

    # --- applied by PendingUpdates.apply, under its lock

    def _apply_call_done(self, update: tuple[str, str, str, str, str, float, str]) -> None:
        protocol, operation, method, code, model, duration_s, version = update
        key = (protocol, operation, method, code, model, version)
        series = self._call_series.get(key)
        if series is None:
            series = (
                self.requests.labels(*key),
                self.request_duration.labels(protocol, operation, method, model, version),
            )
            self._call_series[key] = series
        series[0].inc(1)
        series[1].observe(duration_s)
        if model and operation == "embed" and code != self._ok_codes.get(protocol):
            totals = self._model_totals(model)
            totals.fail_count += 1
            totals.fail_s += duration_s

    def _apply_served(
        self,
        update: tuple[str, str, str, str, str, float, int, int, float, float | None, float, str],
    ) -> None:
        protocol, operation, method, code, model, duration_s = update[:6]
        tokens, output_bytes, queue_s, encode_s, served_at, version = update[6:]
        self._apply_call_done((protocol, operation, method, code, model, duration_s, version))
        series = self._series(model)
        series.tokens.inc(tokens)
        series.output_bytes.inc(output_bytes)
        series.queue_wait.observe(queue_s)
        if encode_s is not None:
            series.encode.observe(encode_s)
        if operation == "embed":
            totals = self._model_totals(model)
            totals.success_count += 1
            totals.success_s += duration_s
            totals.queue_count += 1
            totals.queue_s += queue_s
            totals.last_served_unix_s = max(totals.last_served_unix_s, served_at)

    def _apply_batch_done(self, update: tuple[str, int, int, float]) -> None:
        model, requests, tokens, compute_s = update
        series = self._series(model)
        series.batches.inc(1)
        series.batch_requests.observe(requests)
        series.batch_tokens.observe(tokens)
        series.compute.observe(compute_s)
        totals = self._model_totals(model)
        totals.batches += 1
        totals.compute_s += compute_s

    def _model_totals(self, model: str) -> ModelTotals:
        totals = self._totals.get(model)
        if totals is None:
            totals = self._totals[model] = ModelTotals()
        return totals

    def model_totals(self, model: str) -> ModelTotals | None:
        """A copy of ``model``'s totals, every update made so far applied (None: none)."""
        self._pending.apply()
        with self._pending.lock:
            totals = self._totals.get(model)
            return None if totals is None else dataclasses.replace(totals)

    def _series(self, model: str) -> _ModelSeries:
        series = self._model_series.get(model)
        if series is None:
            series = self._model_series[model] = _ModelSeries(self, model)
        return series

    # --- wiring

    def add_front_end(self, front_end: FrontEnd) -> None:
        """A protocol is served: its calls' series at 0, for every model."""
        with self._pending.lock:  # a scrape may be reading the families meanwhile
            self._front_ends.append(front_end)
            self._ok_codes[front_end.protocol] = front_end.ok
            for model, version in self._models:
                self._start_call_series(front_end, model, version)

    def add_model(self, name: str, version: str = "") -> None:
        """A model version is served: its series at 0 (the calls' once per version, the
        model's once per name)."""
        with self._pending.lock:
            if (name, version) in self._models:
                return
            self._models.append((name, version))
            for front_end in self._front_ends:
                self._start_call_series(front_end, name, version)
            self._series(name)

    # --- the control plane's observer (server/control_plane.ControlObserver)

    def model_added(self, name: str, version: str) -> None:
        self.add_model(name, version)
        with self._pending.lock:  # its loads' and unloads' series at 0 too
            for outcome in ("loaded", "failed"):
                self.model_loads.labels(name, version, outcome)
                self.model_load_duration.labels(name, outcome)
            for outcome in ("unloaded", "failed"):
                self.model_unloads.labels(name, version, outcome)
                self.model_unload_duration.labels(name, outcome)

    def version_loaded(self, name: str, version: str, outcome: str, duration_s: float) -> None:
        with self._pending.lock:  # a scrape may be reading the families meanwhile
            self.model_loads.labels(name, version, outcome).inc(1)
            self.model_load_duration.labels(name, outcome).observe(duration_s)

    def version_unloaded(self, name: str, version: str, outcome: str, duration_s: float) -> None:
        with self._pending.lock:
            self.model_unloads.labels(name, version, outcome).inc(1)
            self.model_unload_duration.labels(name, outcome).observe(duration_s)

    def track_models(
        self, models: Callable[[], list[tuple[ModelLabels, int]]], ready: Callable[[], bool]
    ) -> None:
        """What is served, read at each scrape: (labels, queued tokens) per model version,
        and whether the server is ready."""
        self.registry.register(ModelsCollector(models, ready))

    def track_model_states(self, index: Callable[[], list[IndexEntry]]) -> None:
        """Each model version's state, read at each scrape from the control plane."""
        self.registry.register(ModelStatesCollector(index))

    def track_inflight(self, active_requests: Callable[[], int]) -> None:
        # Read at scrape time: no update at all on the request path.
        self.inflight.set_function(lambda: float(active_requests()))
