"""Several models in one process: an encoder's and a decoder's entrance with their own
vocabularies (V=1000, D=64 with a padding id; V=400, D=24 without), served side by side
by the real server, asked for by name through the real clients and raw stubs.

Each answer is exact against its own model's table under concurrent mixed traffic; ids
valid for one model and not the other are refused only where they should be; names,
defaults, listings, health, metrics and start-up mistakes behave as documented.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokembed.client import (
    AsyncEmbeddingClient,
    EmbeddingClient,
    InvalidInputError,
    ModelNotFoundError,
)
from tokembed.v1 import embedding_pb2 as pb

from support.fixtures import (
    DECODER_D,
    DECODER_V,
    EVERY_BACKEND,
    SMALL_D,
    SMALL_PAD,
    SMALL_V,
)
from support.models import padded
from support.requests import embed_request, stub_for
from support.server import ServerProcess, ServerThread, serve_args, wait_for_async

VOCAB = {"small": SMALL_V, "decoder": DECODER_V}
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def both(small_model_dir: Path, decoder_model_dir: Path, start_server: Any) -> ServerThread:
    server: ServerThread = start_server((small_model_dir, decoder_model_dir))
    return server


@pytest.fixture(scope="module")
def rows(small_rows: np.ndarray, decoder_rows: np.ndarray) -> dict[str, np.ndarray]:
    return {"small": small_rows, "decoder": decoder_rows}


def _expected(
    rows: dict[str, np.ndarray], model: str, request: Any, dtype: str = "float32"
) -> np.ndarray:
    table = rows[model].astype(dtype)
    if isinstance(request, np.ndarray):
        return table[request]
    # The decoder has no padding id: zeros.
    pad = table[SMALL_PAD] if model == "small" else np.zeros(table.shape[1], dtype)
    return padded(table, request, pad)


def _mixed_requests(count: int, seed: int) -> list[tuple[str, Any, str]]:
    """(model, ids, dtype): rectangular and ragged, float32 and float16, tiny and large,
    for both models, each valid for its own model."""
    rng = np.random.default_rng(seed)
    requests: list[tuple[str, Any, str]] = []
    for index in range(count):
        model = ("small", "decoder")[index % 2]
        vocab = VOCAB[model]
        dtype = ("float32", "float16")[(index // 2) % 2]
        kind = index % 5
        if kind == 0:  # large: looked up and encoded off the event loop
            ids: Any = rng.integers(0, vocab, (4, 2048))
        elif kind == 1:  # ragged
            ids = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(1, 40, 3)]
        else:  # tiny
            ids = rng.integers(0, vocab, (1, int(rng.integers(1, 9))))
        requests.append((model, ids, dtype))
    return requests


@EVERY_BACKEND
def test_concurrent_mixed_traffic_gets_each_model_s_own_rows(
    small_model_dir: Path,
    decoder_model_dir: Path,
    start_server: Any,
    rows: dict[str, np.ndarray],
    backend: Any,
) -> None:
    server = start_server((small_model_dir, decoder_model_dir), **backend)
    requests = _mixed_requests(120, seed=21)

    async def all_at_once() -> list[np.ndarray]:
        async with AsyncEmbeddingClient(server.target, chunked_threshold_bytes=None) as client:
            return list(
                await asyncio.gather(
                    *(client.embed(ids, dtype, model=model) for model, ids, dtype in requests)
                )
            )

    answers = asyncio.run(all_at_once())
    for (model, ids, dtype), got in zip(requests, answers, strict=True):
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, _expected(rows, model, ids, dtype), err_msg=model)
    # Chunked answers from threads too, both models at once.
    with (
        EmbeddingClient(server.target, chunked_threshold_bytes=1) as client,
        ThreadPoolExecutor(4) as pool,
    ):
        for model in ("small", "decoder"):
            client.info(model=model)  # each model's D known: every call below goes chunked
        chunked = list(pool.map(lambda r: client.embed(r[1], r[2], model=r[0]), requests[:20]))
    for (model, ids, dtype), got in zip(requests[:20], chunked, strict=True):
        np.testing.assert_array_equal(got, _expected(rows, model, ids, dtype), err_msg=model)
    for model in ("small", "decoder"):
        unary = sum(1 for m, _, _ in requests if m == model)
        chunked_n = sum(1 for m, _, _ in requests[:20] if m == model)
        ok = {"code": "OK", "model": model}
        assert server.metric("tokembed_requests_total", {"method": "Embed", **ok}) == unary
        assert server.metric("tokembed_requests_total", {"method": "EmbedChunked", **ok}) == (
            chunked_n
        )


def test_ids_valid_for_one_model_are_refused_only_by_the_other(
    both: ServerThread, small_rows: np.ndarray, decoder_rows: np.ndarray
) -> None:
    between = [[SMALL_V - 1, DECODER_V]]  # both < 1000; 400 and 999 are >= the decoder's V
    with EmbeddingClient(both.target) as client:
        np.testing.assert_array_equal(client.embed(between, model="small"), small_rows[between])
        with pytest.raises(InvalidInputError) as refused:
            client.embed(between, model="decoder")
        assert "input_ids[0,0] = 999 is outside the vocabulary [0, 400)" in str(refused.value)
        # The refusal harmed nothing: both models still answer.
        np.testing.assert_array_equal(
            client.embed([[DECODER_V - 1]], model="decoder"), decoder_rows[[[DECODER_V - 1]]]
        )
        with pytest.raises(InvalidInputError, match=r"\[0, 1000\)"):
            client.embed([[SMALL_V]], model="small")
    assert both.metric("tokembed_rejections_total", {"reason": "invalid_input"}) == 2
    refused_by = {
        model: both.metric("tokembed_requests_total", {"code": "INVALID_ARGUMENT", "model": model})
        for model in ("small", "decoder")
    }
    assert refused_by == {"small": 1, "decoder": 1}


def test_an_empty_name_is_the_first_model_unless_another_is_the_default(
    small_model_dir: Path, decoder_model_dir: Path, start_server: Any
) -> None:
    first = start_server((small_model_dir, decoder_model_dir))
    chosen = start_server((small_model_dir, decoder_model_dir), default_model="decoder")
    with EmbeddingClient(first.target) as client:
        assert client.embed_result([[1, 2]]).model_name == "small"
        assert client.info().name == "small"
        assert client.models().default_model == "small"
    with EmbeddingClient(chosen.target) as client:
        result = client.embed_result([[1, 2]])
        assert result.model_name == "decoder" and result.hidden_states.shape == (1, 2, DECODER_D)
        assert client.info().name == "decoder"
        assert client.models().default_model == "decoder"
    # The client's own default model, overridden per call.
    with EmbeddingClient(first.target, model_name="decoder") as client:
        assert client.embed([[3]]).shape == (1, 1, DECODER_D)
        assert client.embed([[3]], model="small").shape == (1, 1, SMALL_D)


def test_an_unknown_model_is_not_found_naming_the_models_served(both: ServerThread) -> None:
    with stub_for(both.target) as stub:
        request = embed_request([[1]], model_name="encoder")
        for call in (
            lambda: stub.Embed(request, timeout=10),
            lambda: list(stub.EmbedChunked(request, timeout=10)),
            lambda: stub.GetModelInfo(pb.GetModelInfoRequest(model_name="encoder"), timeout=10),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            assert caught.value.details() == (
                "model 'encoder' is not served here (this server serves 'small', 'decoder')"
            )
        (answer,) = list(stub.EmbedStream(iter([request]), timeout=10))
        assert answer.error.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert answer.error.reason == "not_found"
    with EmbeddingClient(both.target) as client, pytest.raises(ModelNotFoundError):
        client.embed([[1]], model="encoder")
    # Counted under model "": no served model was named.
    assert both.metric("tokembed_requests_total", {"code": "NOT_FOUND", "model": ""}) == 5


def test_each_model_is_described_listed_labelled_and_has_its_health(both: ServerThread) -> None:
    with EmbeddingClient(both.target) as client:
        small, decoder = client.info(model="small"), client.info(model="decoder")
        listed = client.models()
        assert client.health() == "SERVING"
        assert client.health("small") == "SERVING" and client.health("decoder") == "SERVING"
        assert client.health("encoder") == "SERVICE_UNKNOWN"
    assert (small.vocab_size, small.d_model, small.padding_id) == (SMALL_V, SMALL_D, SMALL_PAD)
    assert (decoder.vocab_size, decoder.d_model, decoder.padding_id) == (DECODER_V, DECODER_D, None)
    assert small.backend == decoder.backend == "table"
    assert listed.names == ("small", "decoder") and listed.default_model == "small"
    assert listed["decoder"] == decoder
    for name, vocab in (("small", SMALL_V), ("decoder", DECODER_V)):
        labels = {"name": name, "vocab_size": str(vocab), "backend": "table"}
        assert both.metric("tokembed_model_info", labels) == 1
    # Metrics carry the model: tokens of each, apart.
    with EmbeddingClient(both.target) as client:
        client.embed([[1, 2, 3]], model="small")
        client.embed([[1, 2]], model="decoder")
    assert both.metric("tokembed_tokens_total", {"model": "small"}) == 3
    assert both.metric("tokembed_tokens_total", {"model": "decoder"}) == 2
    assert both.metric("tokembed_batches_total", {"model": "decoder"}) == 1


def test_the_models_share_one_output_budget(
    small_model_dir: Path, decoder_model_dir: Path, start_server: Any
) -> None:
    """Admission bounds the process's memory: one model's answers in flight count against
    a request to the other."""
    from support.backends import HookedLoader

    loader = HookedLoader(open_look_ups=False)
    one_answer = 512 * SMALL_D * 4
    server = start_server(
        (small_model_dir, decoder_model_dir), loader=loader, inline_compute_max_tokens=0,
        max_inflight_output_bytes=one_answer,
    )  # fmt: skip

    async def scenario() -> None:
        async with AsyncEmbeddingClient(server.target, retries=0) as client:
            held = asyncio.ensure_future(client.embed(np.zeros((1, 512), np.int64), model="small"))
            entered = loader.backends["small"].entered
            assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
            from tokembed.client import OverloadedError

            with pytest.raises(OverloadedError, match="output bytes in flight"):
                await client.embed(np.zeros((1, 8), np.int64), model="decoder")
            loader.look_up_gate.open()
            await held
            # The held answer's bytes are given back once gRPC has sent it (a done
            # callback, which may run just after the client has the answer).
            assert await wait_for_async(
                lambda: server.metric("tokembed_inflight_output_bytes") == 0, 10
            )
            await client.embed(np.zeros((1, 8), np.int64), model="decoder")

    asyncio.run(scenario())


def test_serve_takes_several_model_dirs_from_flags_or_the_environment(
    small_model_dir: Path, decoder_model_dir: Path, decoder_rows: np.ndarray
) -> None:
    for args, env in (
        (serve_args(small_model_dir, "--model-dir", str(decoder_model_dir)), None),
        (
            ["--port", "0", "--metrics-port", "0"],
            {"TOKEMBED_MODEL_DIR": f"{small_model_dir},{decoder_model_dir}"},
        ),
    ):
        server = ServerProcess(args, env=env).start()
        try:
            with EmbeddingClient(server.target) as client:
                assert client.models().names == ("small", "decoder")
                np.testing.assert_array_equal(
                    client.embed([[5]], model="decoder"), decoder_rows[[[5]]]
                )
            with grpc.insecure_channel(server.target) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                for service in ("", "small", "decoder"):
                    status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                    assert status.status == SERVING, service
            assert "serving models small, decoder (default small)" in server.output
        finally:
            server.kill()


def _serve_fails(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokembed.cli", "serve", "--port", "0", "--metrics-port", "-1",
         *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_two_models_of_one_name_stop_the_start_with_one_line(
    small_model_dir: Path, tmp_path: Path
) -> None:
    twin = tmp_path / "twin"
    shutil.copytree(small_model_dir, twin)
    result = _serve_fails("--model-dir", str(small_model_dir), "--model-dir", str(twin))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()[-1:]
    assert "two models are named 'small'" in line and str(twin) in line
    assert "Traceback" not in result.stderr


def test_a_bad_directory_among_several_stops_the_start_naming_it(
    small_model_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(small_model_dir, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["vocab_size"] = -1
    (broken / "manifest.json").write_text(json.dumps(manifest))
    result = _serve_fails("--model-dir", str(small_model_dir), "--model-dir", str(broken))
    assert result.returncode == 2
    assert "invalid model directory" in result.stderr and str(broken) in result.stderr
    assert "Traceback" not in result.stderr


def test_a_default_model_nobody_serves_stops_the_start(small_model_dir: Path) -> None:
    result = _serve_fails("--model-dir", str(small_model_dir), "--default-model", "decoder")
    assert result.returncode == 2
    assert "default_model 'decoder' is not one of the models served ('small')" in result.stderr
    assert "Traceback" not in result.stderr
