"""End to end: the real server on a free port, the real client, exact answers."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokembed.client import AsyncEmbeddingClient, EmbeddingClient

from support.fixtures import (
    DEFAULT_D,
    DEFAULT_V,
    SMALL_D,
    SMALL_PAD,
    SMALL_V,
)  # fmt: skip
from support.models import padded


def test_the_keys_on_the_table_are_lost(
    default_model_dir: Path, start_server: Any, default_rows: np.ndarray
) -> None:
    """README example: "The keys on the table are lost." as ids 5..12 -> [1,8,512]."""
    server = start_server(default_model_dir)
    with EmbeddingClient(server.target) as client:
        hidden = client.embed([[5, 6, 7, 8, 9, 10, 11, 12]])
    assert hidden.shape == (1, 8, 512)
    assert hidden.dtype == np.float32
    np.testing.assert_array_equal(hidden[0], default_rows[5:13])  # E[id] * sqrt(512), exactly


def test_model_info_reports_model_provider_and_limits(
    small_model_dir: Path, start_server: Any
) -> None:
    server = start_server(small_model_dir, max_batch_tokens=777, max_tokens_per_request=5000)
    with EmbeddingClient(server.target) as client:
        info = client.model_info()
    assert (info.name, info.vocab_size, info.d_model, info.padding_id) == (
        "small", SMALL_V, SMALL_D, SMALL_PAD,
    )  # fmt: skip
    assert info.scale == pytest.approx(SMALL_D**0.5)
    assert info.execution_provider == "CPUExecutionProvider"
    assert info.limits.max_batch_tokens == 777
    assert info.limits.max_tokens_per_request == 5000


def _random_requests(count: int, seed: int) -> list[Any]:
    """Rectangular and ragged requests of random lengths (1..300 tokens per sequence)."""
    rng = np.random.default_rng(seed)
    requests: list[Any] = []
    for index in range(count):
        batch = int(rng.integers(1, 4))
        if index % 2:
            lengths = rng.integers(1, 300, size=batch)
            requests.append([rng.integers(0, SMALL_V, size=int(n)).tolist() for n in lengths])
        else:
            requests.append(rng.integers(0, SMALL_V, size=(batch, int(rng.integers(1, 300)))))
    return requests


def _expected(small_rows: np.ndarray, request: Any) -> np.ndarray:
    if isinstance(request, np.ndarray):
        return small_rows[request]
    return padded(small_rows, request, small_rows[SMALL_PAD])  # the padding id's row


def test_200_concurrent_requests_each_get_exactly_their_rows(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray
) -> None:
    # The onnxruntime backend batches; every look-up goes through the batcher's executor
    # path, so concurrent requests queue behind a computing batch and batch together.
    server = start_server(
        small_model_dir, inline_compute_max_tokens=0, max_delay_ms=5, float32_table_max_bytes=0
    )
    requests = _random_requests(200, seed=7)
    with EmbeddingClient(server.target) as client:
        alone = [client.embed(request) for request in requests]
    batches_before = server.metric("tokembed_batches_total")

    async def all_at_once() -> list[np.ndarray]:
        async with AsyncEmbeddingClient(server.target) as client:
            return list(await asyncio.gather(*(client.embed(r) for r in requests)))

    together = asyncio.run(all_at_once())
    batches = server.metric("tokembed_batches_total") - batches_before
    for request, single, batched in zip(requests, alone, together, strict=True):
        np.testing.assert_array_equal(batched, single)  # bit-identical, alone or batched
        np.testing.assert_array_equal(batched, _expected(small_rows, request))
    # The batcher did form multi-request batches: fewer batches than requests.
    assert 0 < batches < 200, f"{batches} batches for 200 concurrent requests"
    per_batch_max = server.metric("tokembed_batch_requests_sum") / server.metric(
        "tokembed_batch_requests_count"
    )
    assert per_batch_max > 1.0


def test_ragged_flat_layout_returns_rows_back_to_back(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray
) -> None:
    server = start_server(small_model_dir)
    request = [[1, 2, 3], [4], [5, 6]]
    with EmbeddingClient(server.target) as client:
        result = client.embed_result(request, layout="flat")
    assert result.hidden_states.shape == (6, SMALL_D)
    assert tuple(result.lengths) == (3, 1, 2)
    np.testing.assert_array_equal(result.hidden_states, small_rows[[1, 2, 3, 4, 5, 6]])


def test_float16_output_within_half_an_ulp(small_model_dir: Path, start_server: Any) -> None:
    server = start_server(small_model_dir)
    ids = np.arange(SMALL_V, dtype=np.int64).reshape(8, -1)
    with EmbeddingClient(server.target) as client:
        half = client.embed(ids, "float16")
        full = client.embed(ids)
    assert half.dtype == np.float16
    # Stated bound: round to nearest float16, so at most half a float16 ulp of the value
    # (relative 2**-11), or 2**-25 absolute for the subnormal range.
    error = np.abs(half.astype(np.float64) - full.astype(np.float64))
    bound = np.abs(full.astype(np.float64)) * 2.0**-11 + 2.0**-25
    assert np.all(error <= bound)
    np.testing.assert_array_equal(half, full.astype(np.float16))


def test_int32_ids_give_the_same_answer(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray
) -> None:
    server = start_server(small_model_dir)
    ids = np.array([[3, 999, 0, 42]], dtype=np.int32)
    with EmbeddingClient(server.target) as client:
        got = client.embed(ids)
    np.testing.assert_array_equal(got, small_rows[ids.astype(np.int64)])


def test_a_named_request_gets_the_answer_of_an_unnamed_one(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray
) -> None:
    """Unnamed int64 requests take the server's plain path, named ones the general path
    (EmbeddingService.embed_plain): the same rows, timings and model fields."""
    server = start_server(small_model_dir)
    ids = np.random.default_rng(3).integers(0, SMALL_V, (2, 8))
    with EmbeddingClient(server.target) as unnamed:
        name = unnamed.model_info().name
        plain = unnamed.embed_result(ids)
    with EmbeddingClient(server.target, model_name=name) as named:
        general = named.embed_result(ids)
    np.testing.assert_array_equal(plain.hidden_states, small_rows[ids])
    np.testing.assert_array_equal(plain.hidden_states, general.hidden_states)
    for result in (plain, general):
        timings = result.timings
        assert (timings.queue_seconds, timings.batch_requests, timings.batch_tokens) == (0, 1, 16)
        assert timings.compute_seconds > 0 and timings.server_seconds > 0
        assert (result.model_name, result.lengths) == (name, None)
    assert plain.model_version == general.model_version


def test_answered_calls_give_their_room_back(small_model_dir: Path, start_server: Any) -> None:
    """Each answer's output bytes stay reserved until gRPC has sent them (the RPC's done
    callback), and are given back then: none are left counted once the calls are over."""
    server = start_server(small_model_dir)
    ids = np.random.default_rng(4).integers(0, SMALL_V, (2, 8))
    with EmbeddingClient(server.target) as client:
        for _ in range(20):
            client.embed(ids)
            client.embed(ids.astype(np.int32))
            client.embed(ids, "float16")
        deadline = time.monotonic() + 10
        while server.metric("tokembed_inflight_output_bytes") and time.monotonic() < deadline:
            time.sleep(0.01)
    assert server.metric("tokembed_inflight_output_bytes") == 0


def test_stream_answers_in_order(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray
) -> None:
    server = start_server(small_model_dir)
    inputs = [[[i, i + 1]] for i in range(0, 60, 3)]
    with EmbeddingClient(server.target) as client:
        answers = list(client.embed_stream(inputs))
    assert len(answers) == len(inputs)
    for ids, answer in zip(inputs, answers, strict=True):
        np.testing.assert_array_equal(answer, small_rows[np.asarray(ids)])


def test_a_64_mib_response_works_with_default_settings(
    default_model_dir: Path, start_server: Any, default_rows: np.ndarray
) -> None:
    server = start_server(default_model_dir)
    tokens = 64 * 2**20 // (DEFAULT_D * 4)  # 32768 tokens -> exactly 64 MiB of float32
    ids = (np.arange(tokens, dtype=np.int64) * 7 % DEFAULT_V).reshape(8, -1)
    want = default_rows[ids]
    with EmbeddingClient(server.target, chunked_threshold_bytes=None) as unary:
        got = unary.embed(ids)
    assert got.nbytes == 64 * 2**20
    np.testing.assert_array_equal(got, want)
    with EmbeddingClient(server.target) as chunked:  # default: large answers stream in chunks
        np.testing.assert_array_equal(chunked.embed(ids), want)


@pytest.mark.parametrize("table_bytes", [0, 512 * 2**20], ids=["cast-per-request", "float16-table"])
def test_float16_answers_are_the_same_with_and_without_the_float16_table(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray, table_bytes: int
) -> None:
    server = start_server(small_model_dir, float16_table_max_bytes=table_bytes)
    ragged = [[1, 2, 3], [999], [0, 5]]
    with EmbeddingClient(server.target) as client:
        ragged_half = client.embed(ragged, "float16")
        flat = client.embed(ragged, "float16", layout="flat")
        rect = client.embed(np.arange(SMALL_V).reshape(4, -1), "float16")
    np.testing.assert_array_equal(ragged_half, _expected(small_rows, ragged).astype(np.float16))
    np.testing.assert_array_equal(flat, small_rows[[1, 2, 3, 999, 0, 5]].astype(np.float16))
    np.testing.assert_array_equal(rect, small_rows.reshape(4, -1, SMALL_D).astype(np.float16))
