"""Large unary answers (looked up and encoded off the event loop), through the real
server, from both backends: exact, standard protobuf, never mixed when several are
answered side by side, and small answers between them still exact."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokembed.client import EmbeddingClient
from tokembed.server.core.policy import INLINE_MAX_BYTES
from tokembed.server.process import memory
from tokembed.v1 import embedding_pb2 as pb

from support.fixtures import EVERY_BACKEND, SMALL_D, SMALL_PAD, SMALL_V
from support.requests import embed_request, stub_for

TOKENS = INLINE_MAX_BYTES // (SMALL_D * 2) + 256  # off the loop for both dtypes
WIRE = {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16}


@EVERY_BACKEND
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_large_answers_parse_with_plain_protobuf_and_are_exact(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray, dtype: str, backend: Any
) -> None:
    server = start_server(small_model_dir, **backend)
    ids = np.random.default_rng(7).integers(0, SMALL_V, (4, TOKENS // 4), dtype=np.int64)
    request = embed_request(ids, output_dtype=WIRE[dtype], request_id="large-1")
    options = [("grpc.max_receive_message_length", 64 << 20)]
    with stub_for(server.target, options=options) as stub:
        # Twice: the second answer must not see anything of the first.
        for _ in range(2):
            reply = stub.Embed(request, timeout=30)
            assert list(reply.hidden_states.shape) == [*ids.shape, SMALL_D]
            assert reply.hidden_states.dtype == WIRE[dtype]
            got = np.frombuffer(reply.hidden_states.data, dtype=dtype).reshape(*ids.shape, SMALL_D)
            np.testing.assert_array_equal(got, small_rows[ids].astype(dtype))
            assert reply.request_id == "large-1"
            assert reply.model_name == "small"
            assert reply.timings.compute_seconds > 0 and reply.timings.server_seconds > 0
            assert (reply.timings.batch_requests, reply.timings.batch_tokens) == (1, ids.size)


@EVERY_BACKEND
def test_large_answers_through_the_client_flat_ragged_and_padded(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray, backend: Any
) -> None:
    server = start_server(small_model_dir, **backend)
    rng = np.random.default_rng(8)
    rows = [rng.integers(0, SMALL_V, n) for n in (TOKENS - 40, 40)]
    with EmbeddingClient(server.target, chunked_threshold_bytes=None) as client:
        flat = client.embed(rows, layout="flat")  # the rows in order
        np.testing.assert_array_equal(flat, small_rows[np.concatenate(rows)])
        padded = client.embed(rows)  # rows, then pad rows
        np.testing.assert_array_equal(padded[1, :40], small_rows[rows[1]])
        np.testing.assert_array_equal(
            padded[1, 40:], np.repeat(small_rows[[SMALL_PAD]], TOKENS - 80, 0)
        )
        # And small answers, between and after, still exact.
        np.testing.assert_array_equal(client.embed([[1, 2, 3]]), small_rows[[[1, 2, 3]]])


@EVERY_BACKEND
def test_large_answers_side_by_side_never_mix(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray, backend: Any
) -> None:
    server = start_server(small_model_dir, **backend)
    rng = np.random.default_rng(9)
    batches = [rng.integers(0, SMALL_V, (2, TOKENS // 2)) for _ in range(24)]
    with (
        EmbeddingClient(server.target, chunked_threshold_bytes=None) as client,
        ThreadPoolExecutor(4) as pool,
    ):
        answers = list(pool.map(client.embed, batches))
    for ids, answer in zip(batches, answers, strict=True):
        np.testing.assert_array_equal(answer, small_rows[ids])


def test_one_failed_heap_trim_does_not_end_trimming(
    small_model_dir: Path, start_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    release = memory.release_free_memory

    def failing_once() -> bool:
        if not calls:
            calls.append("failed")
            raise OSError("malloc_trim exploded")
        calls.append("ok")
        return release()

    monkeypatch.setattr(memory, "release_free_memory", failing_once)
    start_server(small_model_dir, memory_trim_interval_s=0.05)
    deadline = time.monotonic() + 5
    while calls.count("ok") < 2:
        assert time.monotonic() < deadline, f"trimming stopped after {calls}"
        time.sleep(0.05)
