"""The series every request updates (server/observability/request_metrics.py) are exposed exactly as
prometheus_client exposes its own counters and histograms after the same updates (less
their ``_created`` series, which ours leave out), and a scrape filtered by name sees them,
up to date."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from tokembed.server.core.calls import OUTCOMES
from tokembed.server.edge.v1.servicer import FRONT_END
from tokembed.server.observability.metrics import (
    BATCH_REQUESTS_BUCKETS,
    BATCH_TOKENS_BUCKETS,
    LATENCY_BUCKETS_S,
    REJECTION_REASONS,
    Metrics,
)

V1 = "tokembed.v1"
# Refused: (protocol, operation, method, code, model, seconds); a second protocol's call
# too (the series are per protocol, whatever front ends are added).
CALLS = [
    (V1, "embed", "Embed", "INVALID_ARGUMENT", "enc", 3.0),
    (V1, "embed", "EmbedStream", "CANCELLED", "", 0.0),
    ("v2", "infer", "ModelInfer", "NOT_FOUND", "enc", 0.001),
]
# Served: (protocol, operation, method, code, model, seconds, tokens, bytes, queue seconds,
# encode seconds or None); exact bucket edges, values past the last bucket, answers not
# framed as one message, and two models.
SERVED = [
    (V1, "embed", "Embed", "OK", "enc", 0.0005, 7, 7 * 4 * 16, 0.0, 0.01),
    (V1, "embed", "Embed", "OK", "dec", 0.00025, 256, 524288, 0.002, 2.5e-5),
    (V1, "embed", "Embed", "OK", "enc", 1e9, 1, 64, 0.0, None),
    (V1, "embed", "EmbedChunked", "OK", "enc", 0.5, 3, 192, 0.25, None),
]
# (model, requests, tokens, seconds)
BATCHES = [("enc", 1, 7, 1e-5), ("dec", 3, 70000, 1e-6), ("enc", 600, 300000, 12.5)]
REJECTED = ["invalid_input", "cancelled", "not_found", "invalid_input"]
# (model, reason) of queued requests dropped before compute
DROPPED = [("enc", "cancelled"), ("dec", "deadline_exceeded"), ("enc", "cancelled")]


def ours() -> CollectorRegistry:
    registry = CollectorRegistry()
    metrics = Metrics(registry, process_collector=False)
    metrics.add_front_end(FRONT_END)
    for call in CALLS:
        metrics.call_done(*call)
    for served in SERVED:
        metrics.call_served(*served)
    for batch in BATCHES:
        metrics.batch_done(*batch)
    for reason in REJECTED:
        metrics.rejected(reason)
    for model, reason in DROPPED:
        metrics.dropped(model, reason)
    return registry


def prometheus_clients_own() -> CollectorRegistry:
    """The same series as prometheus_client's own metrics (what the server used before),
    with the same updates."""
    registry = CollectorRegistry()
    requests = Counter(
        "tokembed_requests",
        "Calls finished, by protocol, operation, method, status code, model and version "
        "(a stream: one per request)",
        ["protocol", "operation", "method", "code", "model", "version"], registry=registry,
    )  # fmt: skip
    duration = Histogram(
        "tokembed_request_duration_seconds",
        "Server time of a call, from decoding the request to handing the answer to the "
        "transport",
        ["protocol", "operation", "method", "model", "version"], buckets=LATENCY_BUCKETS_S,
        registry=registry,
    )  # fmt: skip
    queue = Histogram(
        "tokembed_queue_wait_seconds",
        "Time a served request waited in the batcher before its batch's look-up started",
        ["model"], buckets=LATENCY_BUCKETS_S, registry=registry,
    )  # fmt: skip
    compute = Histogram(
        "tokembed_compute_seconds",
        "Look-up time of one batch: the rows sliced from a table, or an onnxruntime run",
        ["model"], buckets=LATENCY_BUCKETS_S, registry=registry,
    )  # fmt: skip
    encode = Histogram(
        "tokembed_encode_seconds",
        "Time to frame one answer in its protocol's bytes (a chunked answer: its header)",
        ["model"], buckets=LATENCY_BUCKETS_S, registry=registry,
    )  # fmt: skip
    batch_requests = Histogram(
        "tokembed_batch_requests", "Requests per batch", ["model"],
        buckets=BATCH_REQUESTS_BUCKETS, registry=registry,
    )  # fmt: skip
    batch_tokens = Histogram(
        "tokembed_batch_tokens", "Tokens per batch", ["model"], buckets=BATCH_TOKENS_BUCKETS,
        registry=registry,
    )  # fmt: skip
    batches = Counter("tokembed_batches", "Batches computed", ["model"], registry=registry)
    tokens = Counter("tokembed_tokens", "Tokens embedded", ["model"], registry=registry)
    output_bytes = Counter(
        "tokembed_output_bytes", "Bytes of hidden_states returned", ["model"], registry=registry
    )
    rejections = Counter(
        "tokembed_rejections", "Requests refused or dropped, by reason", ["reason"],
        registry=registry,
    )  # fmt: skip
    dropped = Counter(
        "tokembed_batcher_dropped", "Queued requests dropped before compute, by model and reason",
        ["model", "reason"], registry=registry,
    )  # fmt: skip
    for reason in REJECTION_REASONS:  # every reason at 0 from the start
        rejections.labels(reason)
    # The front end's series that can move for calls that reach no model (model ""), at 0
    # from the start: each way such a call can end (core.calls.OUTCOMES).
    for method, operation in FRONT_END.methods.items():
        outcomes = OUTCOMES[operation]
        codes = {FRONT_END.status_of(error("")) for error in outcomes.without_model}
        if not outcomes.ok_with_model:
            codes.add(FRONT_END.ok)
        duration.labels(V1, operation, method, "", "")
        for code in sorted(codes):
            requests.labels(V1, operation, method, code, "", "")
    for protocol, operation, method, code, model, seconds in CALLS:
        requests.labels(protocol, operation, method, code, model, "").inc()
        duration.labels(protocol, operation, method, model, "").observe(seconds)
    for served in SERVED:
        protocol, operation, method, code, model, seconds, count, nbytes, queue_s, encode_s = served
        requests.labels(protocol, operation, method, code, model, "").inc()
        duration.labels(protocol, operation, method, model, "").observe(seconds)
        tokens.labels(model=model).inc(count)
        output_bytes.labels(model=model).inc(nbytes)
        queue.labels(model=model).observe(queue_s)
        if encode_s is not None:
            encode.labels(model=model).observe(encode_s)
        else:
            encode.labels(model=model)  # ours makes a model's series all at once
    for model, n_requests, n_tokens, seconds in BATCHES:
        batches.labels(model=model).inc()
        batch_requests.labels(model=model).observe(n_requests)
        batch_tokens.labels(model=model).observe(n_tokens)
        compute.labels(model=model).observe(seconds)
    for reason in REJECTED:
        rejections.labels(reason).inc()
    for model, reason in DROPPED:
        dropped.labels(model, reason).inc()
    return registry


FAMILIES = (
    "tokembed_requests", "tokembed_request_duration_seconds", "tokembed_queue_wait_seconds",
    "tokembed_compute_seconds", "tokembed_encode_seconds", "tokembed_batch_requests",
    "tokembed_batch_tokens", "tokembed_batches", "tokembed_tokens", "tokembed_output_bytes",
    "tokembed_rejections", "tokembed_batcher_dropped",
)  # fmt: skip
_NAMES = "|".join(FAMILIES)
_FAMILY_OF_LINE = re.compile(
    rf"^(?:# (?:HELP|TYPE|UNIT) )?({_NAMES})(?:_total|_bucket|_count|_sum|_created)?[ {{]"
)


def _family_lines(text: str) -> list[str]:
    """The lines of those families, in order, but their ``_created`` series."""
    return [
        line
        for line in text.splitlines()
        if _FAMILY_OF_LINE.match(line)
        and not re.match(r"^(?:# (?:HELP|TYPE|UNIT) )?\w+_created[ {]", line)
    ]


@pytest.mark.parametrize("generate", [generate_latest, generate_openmetrics])
def test_the_exposition_is_prometheus_clients_own(generate: object) -> None:
    text = generate(ours()).decode()  # type: ignore[operator]
    got = _family_lines(text)
    want = _family_lines(generate(prometheus_clients_own()).decode())  # type: ignore[operator]
    assert len(want) >= 250  # every family, every series
    assert got == want
    assert "_created" not in text  # a timestamp per series, which no dashboard reads


def test_a_scrape_filtered_by_name_sees_the_latest_updates() -> None:
    registry = ours()
    filtered = registry.restricted_registry(
        ["tokembed_requests_total", "tokembed_compute_seconds_count"]
    )
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for metric in filtered.collect()
        for sample in metric.samples
    }
    ok_enc = (
        ("code", "OK"), ("method", "Embed"), ("model", "enc"), ("operation", "embed"),
        ("protocol", V1), ("version", ""),
    )  # fmt: skip
    assert samples[("tokembed_requests_total", ok_enc)] == 2
    assert samples[("tokembed_compute_seconds_count", (("model", "enc"),))] == 2
