"""Metric updates are deferred on the request path (metrics.PendingUpdates); these tests
show that nothing is lost or double-counted, that every reading of the registry sees
them all, and that memory stays bounded when nobody scrapes."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, generate_latest

from tokembed.server.observability.metrics import Metrics, PendingUpdates

# How the calls' bookkeeping (core.calls) labels a tokembed.v1 Embed call.
EMBED = {"protocol": "tokembed.v1", "operation": "embed", "method": "Embed"}


def served(
    metrics: Metrics,
    model: str,
    duration_s: float,
    *,
    tokens: int,
    output_bytes: int,
    queue_s: float,
    encode_s: float | None,
) -> None:
    """``call_served`` of one Embed call, as the calls' bookkeeping reports it."""
    metrics.call_served(
        "tokembed.v1", "embed", "Embed", "OK", model, duration_s, tokens, output_bytes, queue_s,
        encode_s,
    )  # fmt: skip


def test_a_reading_of_the_registry_sees_every_update_made_before_it() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry, process_collector=False)
    served(metrics, "enc", 0.0002, tokens=8, output_bytes=16384, queue_s=0.0, encode_s=2e-5)
    metrics.batch_done("enc", requests=3, tokens=24, compute_s=0.00005)
    metrics.rejected("overloaded")

    def value(name: str, labels: dict[str, str] | None = None) -> float | None:
        return registry.get_sample_value(name, labels or {})

    enc = {"model": "enc"}
    call = {**EMBED, **enc, "version": ""}
    assert value("tokembed_requests_total", {**call, "code": "OK"}) == 1
    assert value("tokembed_request_duration_seconds_count", call) == 1
    assert value("tokembed_request_duration_seconds_bucket", {**call, "le": "0.00025"}) == 1
    assert value("tokembed_request_duration_seconds_bucket", {**call, "le": "0.0001"}) == 0
    assert value("tokembed_tokens_total", enc) == 8
    assert value("tokembed_output_bytes_total", enc) == 16384
    assert value("tokembed_queue_wait_seconds_count", enc) == 1
    assert value("tokembed_encode_seconds_count", enc) == 1
    assert value("tokembed_batches_total", enc) == 1
    assert value("tokembed_batch_tokens_sum", enc) == 24
    assert value("tokembed_rejections_total", {"reason": "overloaded"}) == 1
    # The text exposition a scrape gets reads through the same collection.
    served(metrics, "enc", 0.0001, tokens=2, output_bytes=4096, queue_s=0.0, encode_s=None)
    served(metrics, "dec", 0.0001, tokens=5, output_bytes=4096, queue_s=0.0, encode_s=None)
    exposition = generate_latest(registry)
    assert b'tokembed_tokens_total{model="enc"} 10.0' in exposition
    assert b'tokembed_tokens_total{model="dec"} 5.0' in exposition  # each model its own
    assert b'tokembed_encode_seconds_count{model="enc"} 1.0' in exposition  # None: not one


def test_updates_are_applied_once_each_when_threads_record_and_read_at_once() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry, process_collector=False)
    threads_n, per_thread = 4, 5000
    done = threading.Event()

    def record() -> None:
        for _ in range(per_thread):
            served(metrics, "m", 0.0, tokens=1, output_bytes=2, queue_s=0.0, encode_s=0.0)

    def scrape() -> None:
        while not done.is_set():
            registry.get_sample_value("tokembed_tokens_total", {"model": "m"})

    scraper = threading.Thread(target=scrape)
    scraper.start()
    recorders = [threading.Thread(target=record) for _ in range(threads_n)]
    for thread in recorders:
        thread.start()
    for thread in recorders:
        thread.join()
    done.set()
    scraper.join()
    total = threads_n * per_thread
    m = {"model": "m"}
    assert registry.get_sample_value("tokembed_tokens_total", m) == total
    assert registry.get_sample_value("tokembed_output_bytes_total", m) == 2 * total
    assert registry.get_sample_value("tokembed_queue_wait_seconds_count", m) == total
    assert registry.get_sample_value("tokembed_encode_seconds_count", m) == total
    ok = {**EMBED, "code": "OK", **m, "version": ""}
    assert registry.get_sample_value("tokembed_requests_total", ok) == total


def test_pending_updates_stay_bounded_without_a_scrape() -> None:
    applied: list[float] = []
    pending = PendingUpdates(apply_every=100)
    for value in range(1050):
        pending.add(applied.append, float(value))
        assert len(pending._updates) < 100
    assert applied == [float(v) for v in range(1000)]  # in order, each once
    assert list(pending.collect()) == []
    assert applied == [float(v) for v in range(1050)]
