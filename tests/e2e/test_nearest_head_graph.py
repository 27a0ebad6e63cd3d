"""nearest through the head graph in onnxruntime (``--nearest-head onnxruntime``, on the CPU
provider here; the CUDA provider's run is tests/server/test_head_graph.py's GPU test),
end to end with the real server and client: the answers are the numpy head's, ids and
scores identical, for every stored dtype, both metrics, with and without logits; bad
input is INVALID_ARGUMENT naming the value while the requests beside it are answered."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tc

from tokembed.client import AsyncEmbeddingClient, EmbeddingClient
from tokembed.client.errors import InvalidInputError
from tokembed.export.head import add_head

from support.models import export_model_dir

V, D = 800, 32
DTYPES = ("float32", "float16", "bfloat16")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ...]:
    root = tmp_path_factory.mktemp("nearest-graph")
    made = []
    for dtype in DTYPES:
        directory = export_model_dir(
            root / dtype, vocab_size=V, d_model=D, seed=9, dtype=dtype, name=dtype
        )
        add_head(directory, output_table=None, output_key=None, norm=None)
        made.append(directory)
    return tuple(made)


def _ask(target: str, vectors: np.ndarray) -> list[Any]:
    with EmbeddingClient(target) as client:
        return [
            client.nearest(vectors, k=k, metric=metric, logits=logits, model=dtype)
            for dtype in DTYPES
            for metric in ("dot", "cosine")
            for k, logits in ((1, False), (6, False), (4, True))
        ]


def test_the_graph_answers_as_numpy_through_the_server(
    models: tuple[Path, ...], start_server: Any
) -> None:
    vectors = np.random.default_rng(4).standard_normal((2, 5, D)).astype(np.float32)
    numpy_server = start_server(models, nearest_head="numpy")
    want = _ask(numpy_server.target, vectors)
    graph_server = start_server(models, nearest_head="onnxruntime")
    got = _ask(graph_server.target, vectors)
    # GetModelInfo and V2's ModelConfig say what multiplies.
    with EmbeddingClient(numpy_server.target) as client:
        head = client.info(model="bfloat16").head
        assert head is not None and head.runs_on == "numpy"
    with EmbeddingClient(graph_server.target) as client:
        head = client.info(model="bfloat16").head
        assert head is not None and head.runs_on == "CPUExecutionProvider"
    with tc.InferenceServerClient(graph_server.target) as triton:
        config = triton.get_model_config("float32.nearest", as_json=True)["config"]
    assert config["parameters"]["runs_on"]["string_value"] == "CPUExecutionProvider"
    for expected, found in zip(want, got, strict=True):
        np.testing.assert_array_equal(found.ids, expected.ids)
        np.testing.assert_array_equal(found.scores, expected.scores)
        if expected.logits is not None:
            np.testing.assert_allclose(found.logits, expected.logits, rtol=1e-5, atol=1e-5)


def test_bad_input_fails_alone(models: tuple[Path, ...], start_server: Any) -> None:
    server = start_server(models, nearest_head="onnxruntime", max_delay_ms=20.0)
    rng = np.random.default_rng(5)
    good = [rng.standard_normal((3, D)).astype(np.float32) for _ in range(5)]
    inf = good[0].copy()
    inf[1, 4] = np.inf

    async def run() -> list[Any]:
        async with AsyncEmbeddingClient(server.target) as client:
            calls = [client.nearest(h, k=3, model="bfloat16") for h in good]
            calls += [
                client.nearest(inf, k=3, model="bfloat16"),
                client.nearest(good[1], k=V + 1, model="bfloat16"),
            ]
            return await asyncio.gather(*calls, return_exceptions=True)

    answers = asyncio.run(asyncio.wait_for(run(), 60))
    with EmbeddingClient(server.target) as client:
        alone = [client.nearest(h, k=3, model="bfloat16") for h in good]
    for found, want in zip(answers[: len(good)], alone, strict=True):
        assert not isinstance(found, BaseException), found
        np.testing.assert_array_equal(found.ids, want.ids)
        np.testing.assert_array_equal(found.scores, want.scores)
    assert isinstance(answers[-2], InvalidInputError)
    assert "vectors[1,4] = inf is not finite" in str(answers[-2])
    assert isinstance(answers[-1], InvalidInputError)
    assert f"k = {V + 1} is outside [1, {V}]" in str(answers[-1])
