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
from tokembed.server.answer_arrays import AnswerArrays
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


def _chunked_request(ids: np.ndarray) -> pb.EmbedRequest:
    return pb.EmbedRequest(
        input_ids=pb.Tensor(dtype=pb.DTYPE_INT64, shape=list(ids.shape), data=ids.tobytes())
    )


def test_an_answer_still_being_sent_is_never_refilled_for_another(
    small_model_dir: Path, start_server: Any, expected: np.ndarray
) -> None:
    # Small chunks: a reader that stops reading leaves most of its answer unsent (gRPC's
    # flow control holds the server's stream at a yield, the answer's array still cut
    # from), so answers of the same size asked for meanwhile must get other arrays.
    server = start_server(small_model_dir, stream_chunk_bytes=16 * 1024)
    rng = np.random.default_rng(13)
    paused_ids = rng.integers(0, SMALL_V, (1, TOKENS))
    with grpc.insecure_channel(server.target) as channel:
        stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
        paused = stub.EmbedChunked(_chunked_request(paused_ids), timeout=30)
        received = [next(paused), next(paused)]
        assert received[0].HasField("header") and len(received[1].data) > 0
        with EmbeddingClient(server.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client:
            for _ in range(4):
                ids = rng.integers(0, SMALL_V, (1, TOKENS))
                np.testing.assert_array_equal(client.embed(ids), expected[ids])
        received.extend(paused)  # the rest of the paused answer, read only now
        data = b"".join(chunk.data for chunk in received[1:])
        got = np.frombuffer(data, dtype=np.float32).reshape(1, TOKENS, SMALL_D)
        np.testing.assert_array_equal(got, expected[paused_ids])
        # And a stream cancelled halfway harms nothing after it.
        cancelled = stub.EmbedChunked(_chunked_request(paused_ids), timeout=30)
        assert next(cancelled).HasField("header") and len(next(cancelled).data) > 0
        cancelled.cancel()
    with EmbeddingClient(server.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client:
        for _ in range(2):
            ids = rng.integers(0, SMALL_V, (1, TOKENS))
            np.testing.assert_array_equal(client.embed(ids), expected[ids])


def test_the_arrays_are_let_go_once_the_server_is_idle(
    small_model_dir: Path, start_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What each heap trim found held, and left held (whenever the trims come).
    trims: list[tuple[int, int]] = []
    release_idle = AnswerArrays.release_idle

    def recording(self: AnswerArrays) -> None:
        before = self.held_bytes
        release_idle(self)
        trims.append((before, self.held_bytes))

    monkeypatch.setattr(AnswerArrays, "release_idle", recording)
    server = start_server(small_model_dir, memory_trim_interval_s=0.1)
    ids = np.arange(TOKENS).reshape(1, TOKENS) % SMALL_V
    with EmbeddingClient(server.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client:
        client.embed(ids)
        deadline = time.monotonic() + 5
        while not any(held >= TOKENS * SMALL_D * 4 and left == 0 for held, left in trims):
            assert time.monotonic() < deadline, f"the arrays were never let go: {trims}"
            time.sleep(0.05)
    assert server.server.answer_arrays.held_bytes == 0


def test_a_stopped_server_lets_the_arrays_go(small_model_dir: Path, start_server: Any) -> None:
    server = start_server(small_model_dir, memory_trim_interval_s=60)  # no trim meanwhile
    ids = np.arange(TOKENS).reshape(1, TOKENS) % SMALL_V
    with EmbeddingClient(server.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client:
        client.embed(ids)
    arrays = server.server.answer_arrays
    assert arrays.held_bytes >= TOKENS * SMALL_D * 4
    server.stop()
    assert arrays.held_bytes == 0


def test_no_arrays_kept_without_the_heap_trim_to_let_them_go(
    small_model_dir: Path, start_server: Any, expected: np.ndarray
) -> None:
    server = start_server(small_model_dir, memory_trim_interval_s=0)
    assert server.server.answer_arrays is None
    ids = np.arange(TOKENS).reshape(1, TOKENS) % SMALL_V
    with EmbeddingClient(server.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client:
        np.testing.assert_array_equal(client.embed(ids), expected[ids])


def test_no_arrays_kept_where_the_rules_do_not_hold(
    small_model_dir: Path, start_server: Any, expected: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(AnswerArrays, "reusable", staticmethod(lambda: False))
    server = start_server(small_model_dir)
    assert server.server.answer_arrays is None
    ids = np.arange(TOKENS).reshape(1, TOKENS) % SMALL_V
    with EmbeddingClient(server.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client:
        np.testing.assert_array_equal(client.embed(ids), expected[ids])
