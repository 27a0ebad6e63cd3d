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

# Refused: (method, code, seconds).
RPCS = [("Embed", "INVALID_ARGUMENT", 3.0), ("EmbedStream", "CANCELLED", 0.0)]
# Served: (method, seconds, tokens, bytes, queue seconds, encode seconds or None); exact
# bucket edges, values past the last bucket, and answers not encoded as one message.
SERVED = [
    ("Embed", 0.0005, 7, 7 * 4 * 16, 0.0, 0.01), ("Embed", 0.00025, 256, 524288, 0.002, 2.5e-5),
    ("Embed", 1e9, 1, 64, 0.0, None), ("EmbedChunked", 0.5, 3, 192, 0.25, None),
]  # fmt: skip
BATCHES = [(1, 7, 1e-5), (3, 70000, 1e-6), (600, 300000, 12.5)]  # requests, tokens, seconds


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
        "RPCs finished, by method and gRPC status code (EmbedStream: one per request)",
        ["method", "code"], registry=registry,
    )  # fmt: skip
    duration = Histogram(
        "tokembed_request_duration_seconds",
        "Server time of an RPC, from decoding the request to handing the answer to gRPC",
        ["method"], buckets=LATENCY_BUCKETS_S, registry=registry,
    )  # fmt: skip
    queue = Histogram(
        "tokembed_queue_wait_seconds",
        "Time a served request waited in the batcher before its batch's look-up started",
        buckets=LATENCY_BUCKETS_S, registry=registry,
    )  # fmt: skip
    compute = Histogram(
        "tokembed_compute_seconds",
        "Look-up time of one batch: the onnxruntime run, or the float32 table gather",
        buckets=LATENCY_BUCKETS_S, registry=registry,
    )  # fmt: skip
    encode = Histogram(
        "tokembed_encode_seconds",
        "Time to encode one response's bytes (Embed and EmbedStream answers)",
        buckets=LATENCY_BUCKETS_S, registry=registry,
    )  # fmt: skip
    batch_requests = Histogram(
        "tokembed_batch_requests", "Requests per batch", buckets=BATCH_REQUESTS_BUCKETS,
        registry=registry,
    )  # fmt: skip
    batch_tokens = Histogram(
        "tokembed_batch_tokens", "Tokens per batch", buckets=BATCH_TOKENS_BUCKETS,
        registry=registry,
    )  # fmt: skip
    batches = Counter("tokembed_batches", "Batches computed", registry=registry)
    tokens = Counter("tokembed_tokens", "Tokens embedded", registry=registry)
    output_bytes = Counter(
        "tokembed_output_bytes", "Bytes of hidden_states returned", registry=registry
    )
    for method in RPC_METHODS:
        duration.labels(method=method)
        for code in RPC_CODES:
            requests.labels(method=method, code=code)
    for method, code, seconds in RPCS:
        requests.labels(method=method, code=code).inc()
        duration.labels(method=method).observe(seconds)
    for method, seconds, count, nbytes, queue_s, encode_s in SERVED:
        requests.labels(method=method, code="OK").inc()
        duration.labels(method=method).observe(seconds)
        tokens.inc(count)
        output_bytes.inc(nbytes)
        queue.observe(queue_s)
        if encode_s is not None:
            encode.observe(encode_s)
    for n_requests, n_tokens, seconds in BATCHES:
        batches.inc()
        batch_requests.observe(n_requests)
        batch_tokens.observe(n_tokens)
        compute.observe(seconds)
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
    assert samples[("tokembed_requests_total", (("code", "OK"), ("method", "Embed")))] == 3
    assert samples[("tokembed_compute_seconds_count", ())] == len(BATCHES)
