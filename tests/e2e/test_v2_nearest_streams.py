"""``NAME.nearest`` in the Open Inference Protocol's streams, through tritonclient unchanged
(``start_stream`` / ``async_stream_infer``, and the asyncio ``stream_infer``): nearest
requests beside look-ups on one stream, answered in order, each equal to tokembed.v1's
answer; a bad request answered with its error (naming the value) while the stream goes
on; an output in a shared-memory region refused in a stream, as a look-up's is. And
what V2 does with an answer past the limit (it has no chunked answers)."""

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

from tokembed.client import EmbeddingClient
from tokembed.export.head import add_head

from support.models import export_model_dir

V, D = 400, 24
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = export_model_dir(
        tmp_path_factory.mktemp("v2-nearest-streams") / "m", vocab_size=V, d_model=D, seed=7,
        name="m",
    )  # fmt: skip
    add_head(directory, output_table=None, output_key=None, norm=None)
    return directory


def _vectors(h: np.ndarray, k: int) -> list[tc.InferInput]:
    vectors = tc.InferInput("vectors", list(h.shape), "FP32")
    vectors.set_data_from_numpy(h)
    count = tc.InferInput("k", [1], "INT64")
    count.set_data_from_numpy(np.array([k], dtype=np.int64))
    return [vectors, count]


def _ids(ids: np.ndarray) -> list[tc.InferInput]:
    tensor = tc.InferInput("input_ids", list(ids.shape), "INT64")
    tensor.set_data_from_numpy(ids.astype(np.int64))
    return [tensor]


def _mixed(count: int, seed: int) -> list[tuple[str, np.ndarray, int]]:
    """Nearest requests (model, vectors, k) and look-ups (model, ids, 0), alternating."""
    rng = np.random.default_rng(seed)
    made = []
    for i in range(count):
        if i % 3 == 2:
            made.append(("m", rng.integers(0, V, (1 + i % 2, 3 + i % 5)), 0))
        else:
            made.append(("m.nearest", rng.standard_normal((1 + i % 4, D)).astype(np.float32),
                         1 + i % 6))  # fmt: skip
    return made


def _v1_answers(target: str, requests: list[tuple[str, np.ndarray, int]]) -> list[Any]:
    with EmbeddingClient(target) as v1:
        return [
            v1.nearest(data, k=k, logits=True, model="m") if k else v1.embed(data, model="m")
            for _, data, k in requests
        ]


def _check(result: Any, want: Any, k: int) -> None:
    if k == 0:
        np.testing.assert_array_equal(result.as_numpy("hidden_states"), want)
        return
    np.testing.assert_array_equal(result.as_numpy("ids"), want.ids)
    np.testing.assert_array_equal(result.as_numpy("scores"), want.scores)
    # The logits are the batch's multiply: summed in an order that may differ between
    # batches of other sizes (the ids and scores are re-scored exactly: equal).
    np.testing.assert_allclose(result.as_numpy("logits"), want.logits, rtol=1e-5, atol=1e-5)


def _nearest_outputs() -> list[tc.InferRequestedOutput]:
    return [tc.InferRequestedOutput(name) for name in ("ids", "scores", "logits")]


def test_aio_stream_serves_nearest_beside_look_ups_in_order(tied: Path, start_server: Any) -> None:
    server = start_server(tied)
    requests = _mixed(30, seed=1)
    bad_k, bad_width = 4, 7  # both nearest requests (i % 3 != 2)

    async def sent() -> AsyncIterator[dict[str, Any]]:
        for i, (model, data, k) in enumerate(requests):
            if i == bad_k:
                inputs = _vectors(data, 0)
            elif i == bad_width:
                inputs = _vectors(data[:, :5].copy(), k)
            else:
                inputs = _vectors(data, k) if k else _ids(data)
            outputs = _nearest_outputs() if k else None
            yield {"model_name": model, "inputs": inputs, "outputs": outputs,
                   "request_id": f"s{i}"}  # fmt: skip

    async def run() -> list[tuple[Any, Any]]:
        async with tc_aio.InferenceServerClient(server.target) as client:
            return [answer async for answer in client.stream_infer(sent())]

    answers = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    wanted = _v1_answers(server.target, requests)
    assert len(answers) == len(requests)
    for i, ((result, error), want, (_, _, k)) in enumerate(
        zip(answers, wanted, requests, strict=True)
    ):
        if i == bad_k:
            assert result is None and "k = 0 is outside [1, 400]" in error.message()
            continue
        if i == bad_width:
            assert result is None and "has D = 5, but model 'm' has d_model 24" in error.message()
            continue
        assert error is None, error
        assert result.get_response().id == f"s{i}"
        _check(result, want, k)
    nearest = {"protocol": "v2", "method": "ModelStreamInfer", "operation": "nearest", "model": "m"}
    nearest_count = sum(1 for _, _, k in requests if k)
    assert server.metric("tokembed_requests_total", {**nearest, "code": "OK"}) == nearest_count - 2
    assert server.metric("tokembed_requests_total", {**nearest, "code": "INVALID_ARGUMENT"}) == 2
    embed = {**nearest, "operation": "embed", "code": "OK"}
    assert server.metric("tokembed_requests_total", embed) == len(requests) - nearest_count


def test_sync_stream_callbacks_and_refusals_leave_the_stream_open(
    tied: Path, start_server: Any
) -> None:
    server = start_server(tied)
    requests = _mixed(12, seed=2)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    h = requests[0][1]
    nan = h.copy()
    nan[0, 3] = np.nan
    with tc.InferenceServerClient(server.target) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for i, (model, data, k) in enumerate(requests):
            client.async_stream_infer(
                model, _vectors(data, k) if k else _ids(data), request_id=f"c{i}",
                outputs=_nearest_outputs() if k else None,
                parameters={"metric": "cosine"} if k and i % 2 else None,
            )  # fmt: skip
        got = [answers.get(timeout=TIMEOUT_S) for _ in requests]
        # Each refused alone, named; the stream still answers after them.
        client.async_stream_infer("m.nearest", _vectors(nan, 2), request_id="nan")
        in_region = tc.InferRequestedOutput("ids")
        in_region.set_shared_memory("somewhere", 64)
        client.async_stream_infer("m.nearest", _vectors(h, 2), outputs=[in_region])
        client.async_stream_infer("m.nearest", _vectors(h, 2), request_id="after")
        refused_nan = answers.get(timeout=TIMEOUT_S)
        refused_region = answers.get(timeout=TIMEOUT_S)
        after = answers.get(timeout=TIMEOUT_S)
        client.stop_stream()
    with EmbeddingClient(server.target) as v1:
        wanted = [
            v1.nearest(data, k=k, logits=True, metric="cosine" if i % 2 else "dot", model="m")
            if k else v1.embed(data, model="m")
            for i, (_, data, k) in enumerate(requests)
        ]  # fmt: skip
        want_after = v1.nearest(h, k=2, model="m")
    for i, ((result, error), want, (_, _, k)) in enumerate(zip(got, wanted, requests, strict=True)):
        assert error is None, error
        assert result.get_response().id == f"c{i}"
        _check(result, want, k)
    assert refused_nan[0] is None and "vectors[0,3] = nan is not finite" in refused_nan[1].message()
    assert refused_region[0] is None
    assert "output 'ids' of model 'm.nearest' names a shared-memory region" in (
        refused_region[1].message()
    )
    result, error = after
    assert error is None and result.get_response().id == "after"
    np.testing.assert_array_equal(result.as_numpy("ids"), want_after.ids)
    np.testing.assert_array_equal(result.as_numpy("scores"), want_after.scores)
    assert result.as_numpy("logits") is None


def test_an_answer_over_the_limit_is_refused_by_its_size_alone(
    tied: Path, start_server: Any
) -> None:
    """V2 has no chunked answers: every answer within ``max_output_bytes_per_request``
    fits one message (the limit sets the server's message limit); one past it is
    RESOURCE_EXHAUSTED naming its bytes, before it is computed, in ModelInfer and in a
    stream alike, and the requests beside it are answered."""
    server = start_server(tied, max_output_bytes_per_request=100_000)
    h = np.random.default_rng(3).standard_normal((80, D)).astype(np.float32)
    # 80 vectors: 80 x 2 x 12 + 80 x 400 x 4 = 129,920 bytes with the logits.
    outputs = _nearest_outputs()
    with tc.InferenceServerClient(server.target) as client:
        with pytest.raises(InferenceServerException) as unary:
            client.infer("m.nearest", _vectors(h, 2), outputs=outputs)
        fits = client.infer("m.nearest", _vectors(h[:40], 2), outputs=outputs)
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer("m.nearest", _vectors(h, 2), outputs=outputs, request_id="big")
        client.async_stream_infer("m.nearest", _vectors(h, 2), request_id="no-logits")
        big, small = answers.get(timeout=TIMEOUT_S), answers.get(timeout=TIMEOUT_S)
        client.stop_stream()
    assert unary.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert "response would be 129920 bytes, over the limit of 100000" in unary.value.message()
    assert "the logits are [N, V] float32: leave them out or split" in unary.value.message()
    assert fits.as_numpy("logits").shape == (40, V)
    assert big[0] is None and "response would be 129920 bytes" in big[1].message()
    assert small[1] is None and small[0].as_numpy("ids").shape == (80, 2)
    np.testing.assert_array_equal(small[0].as_numpy("ids")[:40], fits.as_numpy("ids"))
