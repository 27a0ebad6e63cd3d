"""EmbedChunked answers through the real server and client, from both backends: exact
every time (padded ragged ones too), one answer never seen in another when several are
sent side by side, and an answer still being sent (its reader paused) exact once it is
read, whatever was answered meanwhile."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokembed.client import EmbeddingClient
from tokembed.server.core.policy import INLINE_MAX_BYTES

from support.fixtures import EVERY_BACKEND, SMALL_D, SMALL_PAD, SMALL_V
from support.requests import embed_request, stub_for

TOKENS = INLINE_MAX_BYTES // (SMALL_D * 2) + 256  # looked up off the loop, both dtypes
CHUNKED_ABOVE = 64 * 1024  # the client takes EmbedChunked for every answer here


@EVERY_BACKEND
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_answers_one_after_the_other_stay_exact(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray, dtype: str, backend: Any
) -> None:
    server = start_server(small_model_dir, **backend)
    rng = np.random.default_rng(11)
    with EmbeddingClient(server.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client:
        for _ in range(6):
            ids = rng.integers(0, SMALL_V, (2, TOKENS // 2))
            np.testing.assert_array_equal(client.embed(ids, dtype), small_rows[ids].astype(dtype))
        # Ragged, padded: the pad rows are written too, not left from an earlier answer.
        rows = [rng.integers(0, SMALL_V, n) for n in (TOKENS // 2, 40)]
        padded = client.embed(rows, dtype)
        np.testing.assert_array_equal(padded[0], small_rows[rows[0]].astype(dtype))
        np.testing.assert_array_equal(padded[1, :40], small_rows[rows[1]].astype(dtype))
        np.testing.assert_array_equal(
            padded[1, 40:], np.repeat(small_rows[[SMALL_PAD]], TOKENS // 2 - 40, 0).astype(dtype)
        )


@EVERY_BACKEND
def test_answers_side_by_side_never_mix(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray, backend: Any
) -> None:
    server = start_server(small_model_dir, **backend)
    rng = np.random.default_rng(12)
    batches = [rng.integers(0, SMALL_V, (2, TOKENS // 2)) for _ in range(32)]
    with (
        EmbeddingClient(server.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client,
        ThreadPoolExecutor(4) as pool,
    ):
        answers = list(pool.map(client.embed, batches))
    for ids, answer in zip(batches, answers, strict=True):
        np.testing.assert_array_equal(answer, small_rows[ids])


@EVERY_BACKEND
def test_an_answer_still_being_sent_stays_exact_whatever_is_answered_meanwhile(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray, backend: Any
) -> None:
    # Small chunks: a reader that stops reading leaves most of its answer unsent (gRPC's
    # flow control holds the server's stream at a yield, the answer's rows still cut
    # from), while answers of the same size are asked for and answered meanwhile.
    server = start_server(small_model_dir, stream_chunk_bytes=16 * 1024, **backend)
    rng = np.random.default_rng(13)
    paused_ids = rng.integers(0, SMALL_V, (1, TOKENS))
    with stub_for(server.target) as stub:
        paused = stub.EmbedChunked(embed_request(paused_ids), timeout=30)
        received = [next(paused), next(paused)]
        assert received[0].HasField("header") and len(received[1].data) > 0
        with EmbeddingClient(server.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client:
            for _ in range(4):
                ids = rng.integers(0, SMALL_V, (1, TOKENS))
                np.testing.assert_array_equal(client.embed(ids), small_rows[ids])
        received.extend(paused)  # the rest of the paused answer, read only now
        data = b"".join(chunk.data for chunk in received[1:])
        got = np.frombuffer(data, dtype=np.float32).reshape(1, TOKENS, SMALL_D)
        np.testing.assert_array_equal(got, small_rows[paused_ids])
        # And a stream cancelled halfway harms nothing after it.
        cancelled = stub.EmbedChunked(embed_request(paused_ids), timeout=30)
        assert next(cancelled).HasField("header") and len(next(cancelled).data) > 0
        cancelled.cancel()
    with EmbeddingClient(server.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client:
        for _ in range(2):
            ids = rng.integers(0, SMALL_V, (1, TOKENS))
            np.testing.assert_array_equal(client.embed(ids), small_rows[ids])
