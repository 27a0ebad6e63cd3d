"""Tokenizing never delays other requests: while a large batch of texts is tokenized (on a
worker thread of its own), tiny Embed calls keep the latency they have alone. Were the
batch encoded on the event loop, every tiny call sent during it would wait for all of it."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

from tokembed.client import EmbeddingClient

from support.server import ServerProcess, serve_args
from support.text_models import WORDPIECE_SPECIAL, texts

LARGE_BATCH = 4000  # texts of up to ~200 characters: a tokenize of a few hundred ms here
LARGE_CALLS = 5


def _tiny_latencies(client: EmbeddingClient, until: threading.Event | int) -> list[float]:
    latencies = []
    count = 0
    while not (until.is_set() if isinstance(until, threading.Event) else count >= until):
        started = time.perf_counter()
        client.embed([[5]])
        latencies.append(time.perf_counter() - started)
        count += 1
    return latencies


def test_tiny_embeds_keep_their_latency_during_a_large_tokenize(text_model_dir: Path) -> None:
    large = [text[:200] for text in texts(LARGE_BATCH, 11, WORDPIECE_SPECIAL)]
    # A process of its own, as in production: the test's clients share no interpreter with it.
    server = ServerProcess(serve_args(text_model_dir, "--max-tokens-per-request", "1048576"))
    server.start()
    try:
        took, alone, during = _measure(server.target, large)
    finally:
        server.kill()
    assert len(took) == LARGE_CALLS, "the tokenize calls did not finish"
    shortest = min(took)
    # Tiny calls kept running during the large ones (each takes about a ms alone; were the
    # batches encoded on the loop, only the gaps between them would serve any).
    assert len(during) >= 100, (len(during), took)
    # Their typical latency stays near what it is alone (the cores are shared with the
    # tokenizer's threads, so not exactly it), and at most one (the machine is shared:
    # a thread may wait for a core) waited anywhere near a batch; on the loop, one per
    # batch would have waited for all of it.
    median = statistics.median(during)
    assert median < max(5 * alone, alone + 0.005), (median, alone, took)
    waited = [latency for latency in during if latency > shortest / 2]
    assert len(waited) <= 1, (waited, took)


def _measure(target: str, large: list[str]) -> tuple[list[float], float, list[float]]:
    """How long each large tokenize took, the tiny calls' median latency alone, and each
    tiny call's latency while the large ones ran."""
    with EmbeddingClient(target) as client, EmbeddingClient(target) as other:
        _tiny_latencies(client, 50)  # warm up
        alone = statistics.median(_tiny_latencies(client, 200))
        done = threading.Event()
        took: list[float] = []

        def tokenize() -> None:
            try:
                for _ in range(LARGE_CALLS):
                    started = time.perf_counter()
                    result = other.tokenize(large, truncation=True, timeout_s=60)
                    took.append(time.perf_counter() - started)
                    assert len(result.lengths) == LARGE_BATCH
            finally:
                done.set()

        worker = threading.Thread(target=tokenize)
        worker.start()
        during = _tiny_latencies(client, done)
        worker.join(60)
    return took, alone, during
