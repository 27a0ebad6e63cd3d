"""Large unary answers whose rows are written straight into the response bytes
(server/inplace_bytes.py): exact, standard protobuf, and the server goes on serving."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tokembed.client import EmbeddingClient
from tokembed.server import gather as gather_module
from tokembed.server import inplace_bytes, wire
from tokembed.server import service as service_module
from tokembed.server.kept_answers import KeptAnswers
from tokembed.server.service import OFFLOAD_MIN_BYTES
from tokembed.v1 import embedding_pb2 as pb
from tokembed.v1 import embedding_pb2_grpc

from support.fixtures import SMALL_D, SMALL_PAD, SMALL_SEED, SMALL_V
from support.models import reference_rows

TOKENS = OFFLOAD_MIN_BYTES // (SMALL_D * 2) + 256  # in place for both dtypes
WIRE = {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16}


@pytest.fixture(scope="module")
def expected() -> np.ndarray:
    return reference_rows(SMALL_V, SMALL_D, SMALL_SEED, SMALL_PAD)


@pytest.fixture
def finished(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each in-place response was sent as built (True) or re-encoded by copying
    (False): the servers here run in this process, so this sees every one."""
    outcomes: list[bool] = []
    finish = wire.InPlaceResponse.finish

    def recording(self: wire.InPlaceResponse, metadata: bytes) -> bytes | None:
        payload = finish(self, metadata)
        outcomes.append(payload is not None)
        return payload

    monkeypatch.setattr(wire.InPlaceResponse, "finish", recording)
    return outcomes


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_large_answers_parse_with_plain_protobuf_and_are_exact(
    small_model_dir: Path, start_server: Any, expected: np.ndarray, dtype: str, finished: list[bool]
) -> None:
    server = start_server(small_model_dir)
    ids = np.random.default_rng(7).integers(0, SMALL_V, (4, TOKENS // 4), dtype=np.int64)
    request = pb.EmbedRequest(
        input_ids=pb.Tensor(dtype=pb.DTYPE_INT64, shape=list(ids.shape), data=ids.tobytes()),
        output_dtype=WIRE[dtype],  # type: ignore[arg-type]
        request_id="in-place-1",
    )
    options = [("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(server.target, options=options) as channel:
        stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
        # Twice: the second answer must not see anything of the first.
        for _ in range(2):
            reply = stub.Embed(request, timeout=30)
            assert list(reply.hidden_states.shape) == [*ids.shape, SMALL_D]
            assert reply.hidden_states.dtype == WIRE[dtype]
            got = np.frombuffer(reply.hidden_states.data, dtype=dtype).reshape(*ids.shape, SMALL_D)
            np.testing.assert_array_equal(got, expected[ids].astype(dtype))
            assert reply.request_id == "in-place-1"
            assert reply.timings.compute_seconds > 0 and reply.timings.server_seconds > 0
            assert (reply.timings.batch_requests, reply.timings.batch_tokens) == (1, ids.size)
    assert finished == [True, True]  # both sent as built in place, none re-encoded


def test_large_answers_through_the_client_flat_ragged_and_padded(
    small_model_dir: Path, start_server: Any, expected: np.ndarray, finished: list[bool]
) -> None:
    server = start_server(small_model_dir)
    rng = np.random.default_rng(8)
    rows = [rng.integers(0, SMALL_V, n) for n in (TOKENS - 40, 40)]
    with EmbeddingClient(server.target, chunked_threshold_bytes=None) as client:
        flat = client.embed(rows, layout="flat")  # in place: the rows in order
        np.testing.assert_array_equal(flat, expected[np.concatenate(rows)])
        padded = client.embed(rows)  # in place too: rows, then pad rows
        np.testing.assert_array_equal(padded[1, :40], expected[rows[1]])
        np.testing.assert_array_equal(
            padded[1, 40:], np.repeat(expected[[SMALL_PAD]], TOKENS - 80, 0)
        )
        # And small answers, between and after, still exact.
        np.testing.assert_array_equal(client.embed([[1, 2, 3]]), expected[[[1, 2, 3]]])
    assert finished == [True, True]  # the two large answers; the small one is encoded


def test_reused_response_bytes_never_mix_answers(
    small_model_dir: Path,
    start_server: Any,
    expected: np.ndarray,
    finished: list[bool],
    fresh_allocations: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Shared gathers too, so that both run together through the real server.
    monkeypatch.setattr(service_module, "SPLIT_GATHER_MIN_BYTES", OFFLOAD_MIN_BYTES)
    shared: list[int] = []  # one per gather the helper thread took half of
    try_submit = gather_module.GatherHelper.try_submit

    def counting(self: gather_module.GatherHelper, *args: Any) -> Any:
        future = try_submit(self, *args)
        if future is not None:
            shared.append(1)
        return future

    monkeypatch.setattr(gather_module.GatherHelper, "try_submit", counting)
    server = start_server(small_model_dir)
    assert server.server.spare_bytes is not None
    rng = np.random.default_rng(9)
    batches = [rng.integers(0, SMALL_V, (2, TOKENS // 2)) for _ in range(24)]
    with EmbeddingClient(server.target, chunked_threshold_bytes=None) as client:
        # One after the other: every answer after the first may reuse the bytes.
        for ids in batches[:6]:
            np.testing.assert_array_equal(client.embed(ids), expected[ids])
        sequential = len(fresh_allocations)
        assert len(shared) == 6
        # Side by side: bytes still being sent must not be refilled for another answer.
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(client.embed, batches[6:]))
    for ids, answer in zip(batches[6:], answers, strict=True):
        np.testing.assert_array_equal(answer, expected[ids])
    assert sequential <= 3  # most reused the bytes (once gRPC was done with them)
    assert finished == [True] * 24
    assert len(shared) >= 6  # at least one after the other, the helper was free


def test_the_spare_bytes_are_let_go_once_the_server_is_idle(
    small_model_dir: Path, start_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What each heap trim found held, and left held (whenever the trim comes).
    trims: list[tuple[int, int]] = []
    release_idle = inplace_bytes.SpareBytes.release_idle

    def recording(self: inplace_bytes.SpareBytes) -> None:
        before = self.held_bytes
        release_idle(self)
        trims.append((before, self.held_bytes))

    monkeypatch.setattr(inplace_bytes.SpareBytes, "release_idle", recording)
    server = start_server(small_model_dir, memory_trim_interval_s=0.1)
    answer_bytes = TOKENS * SMALL_D * 4
    ids = np.arange(TOKENS).reshape(1, TOKENS) % SMALL_V
    with EmbeddingClient(server.target, chunked_threshold_bytes=None) as client:
        client.embed(ids)
        deadline = time.monotonic() + 5
        while not any(held > answer_bytes and left == 0 for held, left in trims):
            assert time.monotonic() < deadline, f"the spare was never let go: {trims}"
            time.sleep(0.05)
    assert server.server.spare_bytes.held_bytes == 0


def test_no_spare_bytes_without_the_heap_trim_to_let_them_go(
    small_model_dir: Path, start_server: Any
) -> None:
    server = start_server(small_model_dir, memory_trim_interval_s=0)
    assert server.server.spare_bytes is None


def test_a_stopped_server_lets_the_spare_bytes_go(small_model_dir: Path, start_server: Any) -> None:
    server = start_server(small_model_dir, memory_trim_interval_s=60)  # no trim meanwhile
    spare = server.server.spare_bytes
    ids = np.arange(TOKENS).reshape(1, TOKENS) % SMALL_V
    with EmbeddingClient(server.target, chunked_threshold_bytes=None) as client:
        client.embed(ids)
    assert spare.held_bytes > TOKENS * SMALL_D * 4
    server.stop()
    assert spare.held_bytes == 0


def test_one_failed_heap_trim_does_not_end_trimming(
    small_model_dir: Path, start_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    release = KeptAnswers.release_idle

    def failing_once(self: KeptAnswers) -> None:
        if not calls:
            calls.append("failed")
            raise OSError("malloc_trim exploded")
        calls.append("ok")
        release(self)

    monkeypatch.setattr(KeptAnswers, "release_idle", failing_once)
    start_server(small_model_dir, memory_trim_interval_s=0.05)
    deadline = time.monotonic() + 5
    while calls.count("ok") < 2:
        assert time.monotonic() < deadline, f"trimming stopped after {calls}"
        time.sleep(0.05)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_large_chunked_answers_are_gathered_straight_into_their_array(
    small_model_dir: Path,
    start_server: Any,
    expected: np.ndarray,
    dtype: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EmbedChunked's large answers are gathered into the array the chunks are cut from,
    as unary answers are into their bytes: no rows array in between (at the peak, both
    were alive). Flat, padded ragged (pad rows) and plain answers stay exact."""
    gathered_into: list[np.ndarray] = []
    gather_into = service_module.gather_into

    def recording(table: np.ndarray, job: Any, out: np.ndarray, *args: Any) -> Any:
        gathered_into.append(out)
        return gather_into(table, job, out, *args)

    monkeypatch.setattr(service_module, "gather_into", recording)
    server = start_server(small_model_dir)
    rng = np.random.default_rng(10)
    rows = [rng.integers(0, SMALL_V, n) for n in (TOKENS - 40, 40)]
    plain = rng.integers(0, SMALL_V, (2, TOKENS // 2))
    want = expected.astype(dtype)
    with EmbeddingClient(server.target, chunked_threshold_bytes=1) as client:
        flat = client.embed(rows, dtype, layout="flat")
        np.testing.assert_array_equal(flat, want[np.concatenate(rows)])
        padded = client.embed(rows, dtype)
        np.testing.assert_array_equal(padded[0], want[rows[0]])
        np.testing.assert_array_equal(padded[1, :40], want[rows[1]])
        np.testing.assert_array_equal(padded[1, 40:], np.repeat(want[[SMALL_PAD]], TOKENS - 80, 0))
        np.testing.assert_array_equal(client.embed(plain, dtype), want[plain])
        # A small answer is looked up the usual way (no in-place gather), still exact.
        np.testing.assert_array_equal(client.embed([[1, 2, 3]], dtype), want[[[1, 2, 3]]])
    assert [answer.shape for answer in gathered_into] == [
        (TOKENS, SMALL_D), (2, TOKENS - 40, SMALL_D), (2, TOKENS // 2, SMALL_D)
    ]  # fmt: skip
    assert all(answer.dtype == dtype for answer in gathered_into)
    assert server.metric("tokembed_requests_total", {"method": "EmbedChunked", "code": "OK"}) == 4
