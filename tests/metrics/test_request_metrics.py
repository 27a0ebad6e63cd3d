"""The series every request updates (server/request_metrics.py) are exposed exactly as
prometheus_client exposes its own counters and histograms after the same updates, and a
scrape filtered by name sees them, up to date."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from tokembed.server.metrics import (
    BATCH_REQUESTS_BUCKETS,
    BATCH_TOKENS_BUCKETS,
    LATENCY_BUCKETS_S,
    RPC_CODES,
    RPC_METHODS,
    Metrics,
)

# Refused: (method, model, code, seconds).
RPCS = [("Embed", "enc", "INVALID_ARGUMENT", 3.0), ("EmbedStream", "", "CANCELLED", 0.0)]
# Served: (method, model, seconds, tokens, bytes, queue seconds, encode seconds or None);
# exact bucket edges, values past the last bucket, answers not encoded as one message,
# and two models.
SERVED = [
    ("Embed", "enc", 0.0005, 7, 7 * 4 * 16, 0.0, 0.01),
    ("Embed", "dec", 0.00025, 256, 524288, 0.002, 2.5e-5),
    ("Embed", "enc", 1e9, 1, 64, 0.0, None), ("EmbedChunked", "enc", 0.5, 3, 192, 0.25, None),
]  # fmt: skip
# (model, requests, tokens, seconds)
BATCHES = [("enc", 1, 7, 1e-5), ("dec", 3, 70000, 1e-6), ("enc", 600, 300000, 12.5)]


def ours() -> CollectorRegistry:
    registry = CollectorRegistry()
    metrics = Metrics(registry, process_collector=False)
    for rpc in RPCS:
        metrics.rpc_done(*rpc)
    for served in SERVED:
        metrics.served(*served)
    for batch in BATCHES:
        metrics.batch_done(*batch)
    return registry


def prometheus_clients_own() -> CollectorRegistry:
    """The same series as prometheus_client's own metrics (what the server used before),
    with the same updates."""
    registry = CollectorRegistry()
    requests = Counter(
        "tokembed_requests",
        "RPCs finished, by method, gRPC status code and model (EmbedStream: one per request)",
        ["method", "code", "model"], registry=registry,
    )  # fmt: skip
    duration = Histogram(
        "tokembed_request_duration_seconds",
        "Server time of an RPC, from decoding the request to handing the answer to gRPC",
        ["method", "model"], buckets=LATENCY_BUCKETS_S, registry=registry,
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
        "Time to encode one response's bytes (Embed and EmbedStream answers)",
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
    for method in RPC_METHODS:
        duration.labels(method=method, model="")
        for code in RPC_CODES:
            requests.labels(method=method, code=code, model="")
    for method, model, code, seconds in RPCS:
        requests.labels(method=method, code=code, model=model).inc()
        duration.labels(method=method, model=model).observe(seconds)
    for method, model, seconds, count, nbytes, queue_s, encode_s in SERVED:
        requests.labels(method=method, code="OK", model=model).inc()
        duration.labels(method=method, model=model).observe(seconds)
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
    return registry


FAMILIES = (
    "tokembed_requests", "tokembed_request_duration_seconds", "tokembed_queue_wait_seconds",
    "tokembed_compute_seconds", "tokembed_encode_seconds", "tokembed_batch_requests",
    "tokembed_batch_tokens", "tokembed_batches", "tokembed_tokens", "tokembed_output_bytes",
)  # fmt: skip
_NAMES = "|".join(FAMILIES)
_FAMILY_OF_LINE = re.compile(
    rf"^(?:# (?:HELP|TYPE|UNIT) )?({_NAMES})(?:_total|_bucket|_count|_sum|_created)?[ {{]"
)


def _family_lines(text: str) -> list[str]:
    """The lines of those families, in order, with their creation times masked."""
    masked = re.sub(r"(_created(\{[^}]*\})?) \S+", r"\1 T", text)
    return [line for line in masked.splitlines() if _FAMILY_OF_LINE.match(line)]


@pytest.mark.parametrize("generate", [generate_latest, generate_openmetrics])
def test_the_exposition_is_prometheus_clients_own(generate: object) -> None:
    got = _family_lines(generate(ours()).decode())  # type: ignore[operator]
    want = _family_lines(generate(prometheus_clients_own()).decode())  # type: ignore[operator]
    assert len(want) >= 250  # every family, every series
    assert got == want


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
    ok_enc = (("code", "OK"), ("method", "Embed"), ("model", "enc"))
    assert samples[("tokembed_requests_total", ok_enc)] == 2
    assert samples[("tokembed_compute_seconds_count", (("model", "enc"),))] == 2
