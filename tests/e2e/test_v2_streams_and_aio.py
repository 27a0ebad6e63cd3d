"""End to end, the Open Inference Protocol through tritonclient's asyncio client
(``tritonclient.grpc.aio``) and through its streams (``start_stream`` /
``async_stream_infer``, and the asyncio ``stream_infer``): answers exact against the
model's reference rows, a bad request failing alone among good ones."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
from tritonclient.utils import InferenceServerException

from support.fixtures import SMALL_D, SMALL_V

MODEL = "small"
TIMEOUT_S = 30


def ids_input(ids: np.ndarray, name: str = "input_ids") -> tc.InferInput:
    tensor = tc.InferInput(name, list(ids.shape), "INT64")
    tensor.set_data_from_numpy(ids.astype(np.int64))
    return tensor


def requests_with_one_bad(count: int, bad: int) -> list[np.ndarray]:
    """``count`` requests of 1..4 sequences, the ``bad``-th holding an id past V."""
    rng = np.random.default_rng(bad)
    batches = [
        rng.integers(0, SMALL_V, size=(1 + index % 4, 1 + index % 7)) for index in range(count)
    ]
    batches[bad][0, -1] = SMALL_V
    return batches


@pytest.fixture
def server(small_model_dir: Path, start_server: Any) -> Any:
    return start_server(small_model_dir)


def test_aio_client_calls_and_infers_exactly(server: Any, small_rows: Any) -> None:
    async def run() -> None:
        async with tc_aio.InferenceServerClient(server.target) as client:
            assert await client.is_server_live()
            assert await client.is_server_ready()
            assert await client.is_model_ready(MODEL)
            assert (await client.get_server_metadata()).name == "tokembed"
            assert (await client.get_model_metadata(MODEL)).outputs[0].shape == [-1, -1, SMALL_D]
            assert (await client.get_model_config(MODEL)).config.name == MODEL
            index = await client.get_model_repository_index()
            assert [m.name for m in index.models] == [MODEL]
            batches = requests_with_one_bad(24, bad=9)
            # Concurrent calls: the bad one fails alone, the others are exact.
            results = await asyncio.gather(
                *(client.infer(MODEL, [ids_input(ids)], request_id=str(i))
                  for i, ids in enumerate(batches)),
                return_exceptions=True,
            )  # fmt: skip
            for i, (ids, result) in enumerate(zip(batches, results, strict=True)):
                if i == 9:
                    assert isinstance(result, InferenceServerException)
                    assert result.status() == "StatusCode.INVALID_ARGUMENT"
                    assert f"= {SMALL_V} is outside the vocabulary" in result.message()
                    continue
                assert not isinstance(result, BaseException), result
                assert result.get_response().id == str(i)
                np.testing.assert_array_equal(result.as_numpy("hidden_states"), small_rows[ids])
            stats = await client.get_inference_statistics(MODEL)
            assert stats.model_stats[0].inference_stats.success.count == 23

    asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))


def test_aio_stream_answers_in_order_with_the_bad_request_failing_alone(
    server: Any, small_rows: Any
) -> None:
    batches = requests_with_one_bad(40, bad=17)

    async def requests() -> AsyncIterator[dict[str, Any]]:
        for i, ids in enumerate(batches):
            yield {"model_name": MODEL, "inputs": [ids_input(ids)], "request_id": f"s{i}"}

    async def run() -> list[tuple[Any, Any]]:
        async with tc_aio.InferenceServerClient(server.target) as client:
            return [answer async for answer in client.stream_infer(requests())]

    answers = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    assert len(answers) == len(batches)
    for i, ((result, error), ids) in enumerate(zip(answers, batches, strict=True)):
        if i == 17:
            assert result is None
            assert f"input_ids[0,{ids.shape[1] - 1}] = {SMALL_V}" in error.message()
            continue
        assert error is None
        assert result.get_response().id == f"s{i}"
        np.testing.assert_array_equal(result.as_numpy("hidden_states"), small_rows[ids])
    v2_stream = {"protocol": "v2", "method": "ModelStreamInfer", "model": MODEL}
    assert server.metric("tokembed_requests_total", {**v2_stream, "code": "OK"}) == 39
    assert server.metric("tokembed_requests_total", {**v2_stream, "code": "INVALID_ARGUMENT"}) == 1


def test_sync_stream_with_callbacks(server: Any, small_rows: Any) -> None:
    """tritonclient's ``start_stream``: answers come to a callback on its own thread."""
    batches = requests_with_one_bad(30, bad=3)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with tc.InferenceServerClient(server.target) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for i, ids in enumerate(batches):
            client.async_stream_infer(
                MODEL, [ids_input(ids)], request_id=f"c{i}",
                parameters={"datatype": "FP16"} if i % 2 else None,
            )  # fmt: skip
        got = [answers.get(timeout=TIMEOUT_S) for _ in batches]
        # A request for a model not served fails alone too; the stream still answers.
        client.async_stream_infer("nope", [ids_input(batches[0])], request_id="lost")
        result, error = answers.get(timeout=TIMEOUT_S)
        assert result is None and "'nope' is not served" in error.message()
        client.async_stream_infer(MODEL, [ids_input(batches[0])], request_id="after")
        result, error = answers.get(timeout=TIMEOUT_S)
        assert error is None and result.get_response().id == "after"
        client.stop_stream()
    for i, ((result, error), ids) in enumerate(zip(got, batches, strict=True)):
        if i == 3:
            assert result is None and f"= {SMALL_V} is outside the vocabulary" in error.message()
            continue
        assert error is None, error
        assert result.get_response().id == f"c{i}"
        expected = small_rows[ids].astype(np.float16 if i % 2 else np.float32)
        got_rows = result.as_numpy("hidden_states")
        assert got_rows.dtype == expected.dtype
        np.testing.assert_array_equal(got_rows, expected)
