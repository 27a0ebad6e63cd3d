"""EmbedChunked answers gathered into kept arrays (server/answer_arrays.py), through the
real server and client: exact every time, one answer never seen in another, an array
still being sent never refilled, and the arrays let go once the server is idle."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tokembed.client import EmbeddingClient
from tokembed.server.service import OFFLOAD_MIN_BYTES
from tokembed.v1 import embedding_pb2 as pb
from tokembed.v1 import embedding_pb2_grpc

from support.fixtures import SMALL_D, SMALL_PAD, SMALL_SEED, SMALL_V
from support.models import reference_rows

TOKENS = OFFLOAD_MIN_BYTES // (SMALL_D * 2) + 256  # gathered in place for both dtypes
CHUNKED_ABOVE = 64 * 1024  # the client takes EmbedChunked for every answer here


@pytest.fixture(scope="module")
def expected() -> np.ndarray:
    return reference_rows(SMALL_V, SMALL_D, SMALL_SEED, SMALL_PAD)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_answers_one_after_the_other_reuse_one_array_and_stay_exact(
    small_model_dir: Path, start_server: Any, expected: np.ndarray, dtype: str
) -> None:
    server = start_server(small_model_dir, memory_trim_interval_s=60)  # no trim meanwhile
    arrays = server.server.answer_arrays
    assert arrays is not None
    rng = np.random.default_rng(11)
    answer_bytes = TOKENS * SMALL_D * np.dtype(dtype).itemsize
    with EmbeddingClient(server.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client:
        for _ in range(6):
            ids = rng.integers(0, SMALL_V, (2, TOKENS // 2))
            np.testing.assert_array_equal(client.embed(ids, dtype), expected[ids].astype(dtype))
        # Ragged, padded: the pad rows are written too, not left from an earlier answer.
        rows = [rng.integers(0, SMALL_V, n) for n in (TOKENS // 2, 40)]
        padded = client.embed(rows, dtype)
        np.testing.assert_array_equal(padded[0], expected[rows[0]].astype(dtype))
        np.testing.assert_array_equal(padded[1, :40], expected[rows[1]].astype(dtype))
        np.testing.assert_array_equal(
            padded[1, 40:], np.repeat(expected[[SMALL_PAD]], TOKENS // 2 - 40, 0).astype(dtype)
        )
    # Each answer was sent before the next was asked for: one array (two at most, if
    # gRPC had not yet dropped the last chunk), not one per answer.
    assert answer_bytes <= arrays.held_bytes <= 2 * answer_bytes


def test_answers_side_by_side_never_share_an_array(
    small_model_dir: Path, start_server: Any, expected: np.ndarray
) -> None:
    server = start_server(small_model_dir)
    rng = np.random.default_rng(12)
    batches = [rng.integers(0, SMALL_V, (2, TOKENS // 2)) for _ in range(32)]
    with (
        EmbeddingClient(server.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client,
        ThreadPoolExecutor(4) as pool,
    ):
        answers = list(pool.map(client.embed, batches))
    for ids, answer in zip(batches, answers, strict=True):
        np.testing.assert_array_equal(answer, expected[ids])
    assert server.server.answer_arrays.held_bytes > 0


def test_a_stream_cancelled_halfway_leaves_later_answers_exact(
    small_model_dir: Path, start_server: Any, expected: np.ndarray
) -> None:
    server = start_server(small_model_dir)
    rng = np.random.default_rng(13)
    first = rng.integers(0, SMALL_V, (1, TOKENS))
    request = pb.EmbedRequest(
        input_ids=pb.Tensor(dtype=pb.DTYPE_INT64, shape=list(first.shape), data=first.tobytes())
    )
    with grpc.insecure_channel(server.target) as channel:
        stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
        stream = stub.EmbedChunked(request, timeout=30)
        assert next(stream).HasField("header")
        assert len(next(stream).data) > 0  # one chunk read, the rest left unsent
        stream.cancel()
    with EmbeddingClient(server.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client:
        for _ in range(4):
            ids = rng.integers(0, SMALL_V, (1, TOKENS))
            np.testing.assert_array_equal(client.embed(ids), expected[ids])


def test_the_arrays_are_let_go_once_the_server_is_idle_and_when_it_stops(
    small_model_dir: Path, start_server: Any
) -> None:
    server = start_server(small_model_dir, memory_trim_interval_s=0.1)
    arrays = server.server.answer_arrays
    ids = np.arange(TOKENS).reshape(1, TOKENS) % SMALL_V
    with EmbeddingClient(server.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client:
        client.embed(ids)
        assert arrays.held_bytes >= TOKENS * SMALL_D * 4
        deadline = time.monotonic() + 5
        while arrays.held_bytes:
            assert time.monotonic() < deadline, "the arrays were never let go"
            time.sleep(0.05)
    kept = start_server(small_model_dir, memory_trim_interval_s=60)  # no trim meanwhile
    with EmbeddingClient(kept.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client:
        client.embed(ids)
    assert kept.server.answer_arrays.held_bytes >= TOKENS * SMALL_D * 4
    kept.stop()
    assert kept.server.answer_arrays.held_bytes == 0


def test_no_arrays_kept_without_the_heap_trim_to_let_them_go(
    small_model_dir: Path, start_server: Any, expected: np.ndarray
) -> None:
    server = start_server(small_model_dir, memory_trim_interval_s=0)
    assert server.server.answer_arrays is None
    ids = np.arange(TOKENS).reshape(1, TOKENS) % SMALL_V
    with EmbeddingClient(server.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client:
        np.testing.assert_array_equal(client.embed(ids), expected[ids])
