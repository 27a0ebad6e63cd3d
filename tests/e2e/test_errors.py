"""End to end: bad input fails alone, with its code and a message naming the value."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tokembed.client import (
    AsyncEmbeddingClient,
    DeadlineExceededError,
    EmbeddingClient,
    InvalidInputError,
    ModelNotFoundError,
    OverloadedError,
    RequestTooLargeError,
    UnavailableError,
)  # fmt: skip
from tokembed.server.process.settings import Settings
from tokembed.v1 import embedding_pb2 as pb

from support.backends import HOLDABLE, HookedLoader
from support.requests import embed_request, stub_for
from support.server import ServerThread, wait_for, wait_for_async


def queued_tokens(server: ServerThread) -> float:
    return server.metric("tokembed_queued_tokens")


BAD_REQUESTS = [
    ("id -1", embed_request([[1, -1]]),
     grpc.StatusCode.INVALID_ARGUMENT, "input_ids[0,1] = -1 is outside the vocabulary [0, 1000)"),
    ("id V", embed_request([[1000]]),
     grpc.StatusCode.INVALID_ARGUMENT, "input_ids[0,0] = 1000 is outside"),
    ("float ids", embed_request([[1.0]], ids_dtype=pb.DTYPE_FLOAT32),
     grpc.StatusCode.INVALID_ARGUMENT, "dtype DTYPE_FLOAT32 is not supported"),
    ("unknown dtype", embed_request([[1]], ids_dtype=77),
     grpc.StatusCode.INVALID_ARGUMENT, "77"),
    ("length vs shape", embed_request([[1, 2]], shape=[1, 3]),
     grpc.StatusCode.INVALID_ARGUMENT, "16 bytes, but shape [1, 3]"),
    ("huge shape", embed_request([[1]], shape=[2**40, 2**40]),
     grpc.StatusCode.INVALID_ARGUMENT, "needs"),
    ("ragged sum", embed_request([1, 2, 3], lengths=[2, 2]),
     grpc.StatusCode.INVALID_ARGUMENT, "lengths sum to 4"),
    ("zero length", embed_request([1, 2], lengths=[2, 0]),
     grpc.StatusCode.INVALID_ARGUMENT, "lengths[1] = 0"),
    ("empty", embed_request(np.zeros((1, 0), np.int64)),
     grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    ("bad output dtype", embed_request([[1]], output_dtype=pb.DTYPE_INT32),
     grpc.StatusCode.INVALID_ARGUMENT, "output_dtype DTYPE_INT32"),
    ("unknown model", embed_request([[1]], model_name="bert"),
     grpc.StatusCode.NOT_FOUND, "model 'bert' is not served here"),
    ("too many tokens", embed_request(np.zeros((1, 5001), np.int64)),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "5001 tokens, over the limit of 5000"),
]  # fmt: skip


@pytest.fixture(scope="module")
def shared_server(small_model_dir: Path) -> Iterator[ServerThread]:
    """One server for the many bad-input cases (each case checks it still answers)."""
    settings = Settings(model_dir=small_model_dir, port=0, metrics_port=0,
                        max_tokens_per_request=5000)  # fmt: skip
    server = ServerThread(settings.validate()).start()
    yield server
    server.stop()


@pytest.mark.parametrize(("name", "request_", "code", "message"), BAD_REQUESTS,
                         ids=[b[0] for b in BAD_REQUESTS])  # fmt: skip
def test_each_bad_input_gets_its_code_and_message(
    shared_server: ServerThread, small_rows: np.ndarray, name: str, request_: pb.EmbedRequest,
    code: grpc.StatusCode, message: str,
) -> None:  # fmt: skip
    server = shared_server
    with stub_for(server.target) as stub:
        with pytest.raises(grpc.RpcError) as caught:
            stub.Embed(request_, timeout=10)
        assert caught.value.code() == code
        assert message in caught.value.details()
        # ... and the server answers exactly afterwards.
        ok = stub.Embed(embed_request([[7, 999]]), timeout=10)
        assert ok.hidden_states.dtype == pb.DTYPE_FLOAT32
        got = np.frombuffer(ok.hidden_states.data, "<f4").reshape(list(ok.hidden_states.shape))
        np.testing.assert_array_equal(got, small_rows[[[7, 999]]])


def test_client_raises_typed_errors(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray
) -> None:
    server = start_server(small_model_dir, max_output_bytes_per_request=64 * 1024)
    with EmbeddingClient(server.target, model_name="") as client:
        with pytest.raises(InvalidInputError) as invalid:
            client.embed([[1, 1000]])
        assert invalid.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "1000" in str(invalid.value)
        np.testing.assert_array_equal(client.embed([[1, 999]]), small_rows[[[1, 999]]])
        with pytest.raises(RequestTooLargeError) as large:
            client.embed(np.zeros((1, 300), np.int64))  # 300 x 64 x 4 > 64 KiB
        assert large.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The same ids in float16 fit (half the bytes), and are the rows rounded to float16.
        ids = np.arange(300, dtype=np.int64).reshape(1, 300)
        np.testing.assert_array_equal(
            client.embed(ids, "float16"), small_rows[ids].astype(np.float16)
        )
    with (
        EmbeddingClient(server.target, model_name="other") as client,
        pytest.raises(ModelNotFoundError),
    ):
        client.embed([[1]])


def test_a_bad_request_among_good_ones_fails_alone(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray
) -> None:
    loader = HookedLoader(open_look_ups=False)
    server = start_server(small_model_dir, loader=loader, **HOLDABLE)
    good = [np.array([[i, i + 1, i + 2]]) for i in range(0, 60, 3)]
    backend = loader.backend
    assert backend is not None

    async def scenario() -> tuple[Any, list[Any], BaseException | None]:
        async with AsyncEmbeddingClient(server.target) as client:
            blocker = asyncio.ensure_future(client.embed([[1]]))  # holds the runtime
            assert await wait_for_async(backend.entered.is_set, 10)
            tasks = [asyncio.ensure_future(client.embed(ids)) for ids in good[:10]]
            bad = asyncio.ensure_future(client.embed([[5, -1, 6]]))
            tasks += [asyncio.ensure_future(client.embed(ids)) for ids in good[10:]]
            assert await wait_for_async(lambda: queued_tokens(server) == 60, 10)
            error = None
            try:
                await bad  # refused while the good ones wait in the queue
            except InvalidInputError as exc:
                error = exc
            loader.look_up_gate.open()  # now the queued good requests compute together
            return await blocker, await asyncio.gather(*tasks), error

    first, results, error = asyncio.run(scenario())
    assert error is not None and "-1" in str(error)
    np.testing.assert_array_equal(first, small_rows[[[1]]])
    for ids, got in zip(good, results, strict=True):
        np.testing.assert_array_equal(got, small_rows[ids])
    # One batch after the blocker held all twenty good requests, and never the bad one.
    assert len(backend.calls) == 2
    assert sorted(backend.calls[1].ids.tolist()) == list(range(60))


def test_cancelled_and_expired_requests_disturb_nobody(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray
) -> None:
    loader = HookedLoader(open_look_ups=False)
    server = start_server(small_model_dir, loader=loader, **HOLDABLE)

    backend = loader.backend
    assert backend is not None

    async def scenario() -> list[np.ndarray]:
        async with AsyncEmbeddingClient(server.target, retries=0) as client:
            blocker = asyncio.ensure_future(client.embed([[1]]))  # holds the runtime
            assert await wait_for_async(backend.entered.is_set, 10)
            cancelled = asyncio.ensure_future(client.embed([[888, 887]]))
            expiring = asyncio.ensure_future(client.embed([[777, 776]], timeout_s=2))
            others = [asyncio.ensure_future(client.embed([[i]])) for i in range(2, 12)]
            # All twelve are queued (2 + 2 + 10 tokens) before one leaves.
            assert await wait_for_async(lambda: queued_tokens(server) == 14, 10)
            cancelled.cancel()
            with pytest.raises(DeadlineExceededError):
                await expiring
            # The server has seen both leave (their handlers ended; eleven calls are left)
            # before the runtime frees.
            assert await wait_for_async(
                lambda: server.metric("tokembed_inflight_requests") == 11, 10
            )
            loader.look_up_gate.open()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            return [await blocker, *[await task for task in others]]

    results = asyncio.run(scenario())
    for index, got in enumerate(results):
        np.testing.assert_array_equal(got, small_rows[[[1 if index == 0 else index + 1]]])
    assert loader.backend is not None
    computed = np.concatenate([call.ids for call in loader.backend.calls])
    assert 888 not in computed and 777 not in computed  # dropped before compute
    assert wait_for(
        lambda: server.metric("tokembed_batcher_dropped_total", {"reason": "cancelled"}) == 1, 5
    )
    assert server.metric("tokembed_batcher_dropped_total", {"reason": "deadline_exceeded"}) == 1


def test_a_full_queue_answers_resource_exhausted_at_once(
    small_model_dir: Path, start_server: Any
) -> None:
    loader = HookedLoader(open_look_ups=False)
    server = start_server(
        small_model_dir,
        loader=loader,
        **HOLDABLE,
        max_queued_tokens=10,
    )

    backend = loader.backend
    assert backend is not None

    async def scenario() -> float:
        async with AsyncEmbeddingClient(server.target, retries=0) as client:
            first = asyncio.ensure_future(client.embed([[1]]))  # computing, at the gate
            assert await wait_for_async(backend.entered.is_set, 10)
            queued = asyncio.ensure_future(client.embed([list(range(8))]))  # 8 queued tokens
            assert await wait_for_async(lambda: queued_tokens(server) == 8, 10)
            started = time.monotonic()
            with pytest.raises(OverloadedError):
                await client.embed([list(range(5))])  # 8 + 5 > 10
            elapsed = time.monotonic() - started
            loader.look_up_gate.open()
            await first
            await queued
            return elapsed

    assert asyncio.run(scenario()) < 1.0
    assert server.metric("tokembed_rejections_total", {"reason": "overloaded"}) == 1


def test_a_look_up_failure_fails_its_batch_with_internal_and_the_server_goes_on(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray
) -> None:
    loader = HookedLoader()
    server = start_server(small_model_dir, loader=loader, **HOLDABLE)
    assert loader.backend is not None
    loader.backend.fail_next = True
    with EmbeddingClient(server.target, retries=0) as client:
        with pytest.raises(Exception) as failed:
            client.embed([[1, 2]])
        assert getattr(failed.value, "code", None) == grpc.StatusCode.INTERNAL
        np.testing.assert_array_equal(client.embed([[1, 2]]), small_rows[[[1, 2]]])


def test_client_against_a_stopped_server_raises_unavailable_after_retries(
    small_model_dir: Path, start_server: Any
) -> None:
    server = start_server(small_model_dir)
    target = server.target
    server.stop()
    with EmbeddingClient(target, retries=3, backoff_s=0.01, timeout_s=10) as client:
        started = time.monotonic()
        with pytest.raises(UnavailableError) as caught:
            client.embed([[1]])
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert caught.value.attempts == 4  # one try and three retries
    assert time.monotonic() - started < 10


def test_malformed_model_info_request_is_invalid_argument(shared_server: ServerThread) -> None:
    with grpc.insecure_channel(shared_server.target) as channel:
        raw = channel.unary_unary("/tokembed.v1.EmbeddingService/GetModelInfo")
        with pytest.raises(grpc.RpcError) as caught:
            raw(b"\xff\xff\xff", timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GetModelInfoRequest" in caught.value.details()


def test_chunked_answer_from_a_shared_batch_owns_its_rows(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray
) -> None:
    """A chunked answer computed in a batch with others is correct and independent."""
    loader = HookedLoader(open_look_ups=False)
    server = start_server(small_model_dir, loader=loader, **HOLDABLE)
    backend = loader.backend
    assert backend is not None

    async def scenario() -> list[np.ndarray]:
        async with AsyncEmbeddingClient(server.target, chunked_threshold_bytes=1) as client:
            await client.info()  # D known: every call below goes chunked
            first = asyncio.ensure_future(client.embed([[1]]))  # holds the runtime
            assert await wait_for_async(backend.entered.is_set, 10)
            batched = [asyncio.ensure_future(client.embed([[i, i + 1]])) for i in range(2, 8)]
            assert await wait_for_async(lambda: queued_tokens(server) == 12, 10)
            loader.look_up_gate.open()
            return [await first, *[await task for task in batched]]

    results = asyncio.run(scenario())
    np.testing.assert_array_equal(results[0], small_rows[[[1]]])
    for i, got in zip(range(2, 8), results[1:], strict=True):
        np.testing.assert_array_equal(got, small_rows[[[i, i + 1]]])
    assert server.metric("tokembed_requests_total", {"method": "EmbedChunked", "code": "OK"}) == 7
    assert [len(call.ids) for call in backend.calls] == [1, 12]  # the six shared one batch
