"""Several models behind one server: the per-call ``model=``, ``info(model=)``, ``models()``
and each model's own D in the chunked choice, for both clients (against the loopback fake
of client_fakes.py serving two or three models, each with its own D)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from dataclasses import FrozenInstanceError
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from client_fakes import FAKE_NAME, Abort, D, FakeServer, FakeService, rows

from tokembed.cli.main import main
from tokembed.client import (
    AsyncEmbeddingClient,
    EmbeddingClient,
    EmbedResult,
    InvalidInputError,
    ModelInfo,
    ModelList,
    ModelNotFoundError,
)
from tokembed.client.results import Limits
from tokembed.v1 import embedding_pb2 as pb

T = TypeVar("T")
DEC = "dec"
D_DEC = 16  # != D: an answer's shape tells which model made it
IDS = [[1, 2, 3]]


@pytest.fixture
def two(fake_factory: Callable[..., FakeServer]) -> FakeServer:
    """The default model (FAKE_NAME, D=8) and "dec" (D=16)."""
    return fake_factory(FakeService(more_models={DEC: D_DEC}))


def sync_client(server: FakeServer, **kwargs: Any) -> EmbeddingClient:
    kwargs.setdefault("timeout_s", 10.0)
    return EmbeddingClient(server.address, **kwargs)


def async_client(server: FakeServer, **kwargs: Any) -> AsyncEmbeddingClient:
    kwargs.setdefault("timeout_s", 10.0)
    return AsyncEmbeddingClient(server.address, **kwargs)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def sent(server: FakeServer, method: str) -> list[str]:
    """The model_name of each ``method`` request the server received, in order."""
    return [c.request.model_name for c in server.service.calls if c.method == method]


# ---------------------------------------------------------------- per-call model, sync


def test_per_call_model_reaches_the_server_unary(two: FakeServer) -> None:
    with sync_client(two, chunked_threshold_bytes=None) as client:
        dec = client.embed(IDS, model=DEC)
        default = client.embed(IDS)
        result = client.embed_result(IDS, model=DEC)
    assert sent(two, "Embed") == [DEC, "", DEC]
    assert dec.shape == (1, 3, D_DEC)
    assert np.array_equal(dec, rows(IDS, D_DEC))
    assert np.array_equal(default, rows(IDS, D))
    assert result.model_name == DEC
    assert np.array_equal(result.hidden_states, rows(IDS, D_DEC))


def test_per_call_model_overrides_the_clients_model_name(two: FakeServer) -> None:
    with sync_client(two, model_name=DEC, chunked_threshold_bytes=None) as client:
        client.embed(IDS)  # the client's model_name
        client.embed(IDS, model=FAKE_NAME)
        hs = client.embed(IDS, model="")  # "": the server's default, not the client's
    assert sent(two, "Embed") == [DEC, FAKE_NAME, ""]
    assert hs.shape == (1, 3, D)


def test_per_call_model_on_the_chunked_path(two: FakeServer) -> None:
    with sync_client(two, chunked_threshold_bytes=0) as client:
        hs = client.embed(IDS, model=DEC)
        result = client.embed_result(IDS, model=DEC)
    assert sent(two, "EmbedChunked") == [DEC, DEC]
    assert np.array_equal(hs, rows(IDS, D_DEC))
    assert result.model_name == DEC


def test_per_call_model_on_the_stream(two: FakeServer) -> None:
    inputs = [[[1]], [[2, 3]]]
    with sync_client(two) as client:
        arrays = list(client.embed_stream(inputs, model=DEC))
        results = list(client.embed_stream_results(inputs))
        mixed = list(client.embed_stream_results(inputs, model=DEC, return_exceptions=True))
    assert sent(two, "EmbedStream.item") == [DEC, DEC, "", "", DEC, DEC]
    assert [a.shape for a in arrays] == [(1, 1, D_DEC), (1, 2, D_DEC)]
    assert [r.hidden_states.shape[-1] for r in results] == [D, D]
    assert all(isinstance(r, EmbedResult) and r.model_name == DEC for r in mixed)


def test_model_must_be_text(two: FakeServer) -> None:
    with sync_client(two) as client, pytest.raises(InvalidInputError, match="model must be"):
        client.embed(IDS, model=3)  # type: ignore[arg-type]
    assert two.service.calls == []


# ---------------------------------------------------------------- unknown models


def test_unknown_model_per_call_is_model_not_found(two: FakeServer) -> None:
    # With chunking on, the first call for a model asks GetModelInfo for its D, and the
    # server's NOT_FOUND comes from there; with chunking off, from Embed itself.
    for threshold, method in ((1024, "GetModelInfo"), (None, "Embed")):
        with (
            sync_client(two, chunked_threshold_bytes=threshold, retries=3) as client,
            pytest.raises(ModelNotFoundError) as info,
        ):
            client.embed(IDS, model="nope")
        assert "'nope' is not served here" in str(info.value)
        assert str(sorted([FAKE_NAME, DEC])) in info.value.details
        assert sent(two, method)[-1] == "nope"
        assert info.value.attempts == 1  # not retried
    assert two.service.count("Embed") == 1


def test_unknown_model_on_the_stream(two: FakeServer) -> None:
    with sync_client(two) as client:
        out = list(client.embed_stream_results([[[1]]], model="nope", return_exceptions=True))
        with pytest.raises(ModelNotFoundError, match="'nope' is not served"):
            list(client.embed_stream([[[1]]], model="nope"))
    assert isinstance(out[0], ModelNotFoundError)
    assert DEC in str(out[0])


def test_unknown_model_in_info(two: FakeServer) -> None:
    with sync_client(two) as client, pytest.raises(ModelNotFoundError, match="not served"):
        client.info("nope")


# ---------------------------------------------------------------- info, models, sync


def test_info_names_the_model(two: FakeServer) -> None:
    with sync_client(two, model_name=DEC) as client:
        dec = client.info()  # the client's model_name
        default = client.info("")
        by_name = client.info(FAKE_NAME, timeout_s=5)
        old_name = client.model_info(model=DEC)
        old_call = client.model_info(timeout_s=5)
    assert sent(two, "GetModelInfo") == [DEC, "", FAKE_NAME, DEC, DEC]
    assert (dec.name, dec.d_model, dec.backend) == (DEC, D_DEC, "onnxruntime")
    assert (default.name, default.d_model, default.backend) == (FAKE_NAME, D, "table")
    assert by_name == default
    assert old_name == old_call == dec
    assert EmbeddingClient.model_info is EmbeddingClient.info  # one method, two names


def test_models_decodes_list_models(two: FakeServer) -> None:
    with sync_client(two) as client:
        served = client.models()
    assert two.service.count("ListModels") == 1
    assert isinstance(served, ModelList)
    assert served.default_model == FAKE_NAME
    assert served.names == (FAKE_NAME, DEC)
    assert len(served) == 2
    assert [info.d_model for info in served] == [D, D_DEC]
    assert served[DEC].d_model == D_DEC
    assert served[DEC].backend == "onnxruntime"
    assert served[FAKE_NAME].limits.max_batch_tokens == 8192
    assert DEC in served and "nope" not in served
    assert served.get("nope") is None
    with pytest.raises(KeyError, match="nope"):
        served["nope"]
    with pytest.raises(FrozenInstanceError):
        served.default_model = "x"  # type: ignore[misc]


def test_models_is_retried_on_unavailable(two: FakeServer) -> None:
    two.service.script.append(Abort(grpc.StatusCode.UNAVAILABLE, "unavailable"))
    with sync_client(two, backoff_s=0.01) as client:
        assert client.models().names == (FAKE_NAME, DEC)
    assert two.service.count("ListModels") == 2


def test_model_info_built_without_backend() -> None:
    limits = Limits(1, 2, 3, 4, 0.5)
    info = ModelInfo("m", "1", 10, 4, 1.0, None, "float32", (), (), "CPU", limits, "00")
    assert info.backend == ""
    assert ModelInfo.from_proto(pb.ModelInfo(backend="table")).backend == "table"


def test_model_list_from_proto() -> None:
    message = pb.ListModelsResponse(
        models=[pb.ModelInfo(name="enc", d_model=4), pb.ModelInfo(name="dec", d_model=6)],
        default_model="enc",
    )
    served = ModelList.from_proto(message)
    assert served.names == ("enc", "dec")
    assert served["dec"].d_model == 6
    assert served.default_model == "enc"
    assert ModelList.from_proto(pb.ListModelsResponse()).names == ()


# ---------------------------------------------------------------- each model's D


@pytest.fixture
def small_and_big(fake_factory: Callable[..., FakeServer]) -> FakeServer:
    """The default model with D=8 and "big" with D=4096 behind one server."""
    return fake_factory(FakeService(more_models={"big": 4096}))


# [1,100] float32 ids: 3200 bytes at D=8, 1.6 MB at D=4096; the threshold lies between.
BIG_IDS = np.arange(100).reshape(1, 100)
THRESHOLD = 100_000


def expected_calls() -> list[tuple[str, str]]:
    return [
        ("GetModelInfo", "big"),
        ("EmbedChunked", "big"),
        ("GetModelInfo", ""),  # the default model's D is its own, asked once
        ("Embed", ""),
        ("EmbedChunked", "big"),  # both D known now: no more GetModelInfo
        ("Embed", ""),
    ]


def calls(server: FakeServer) -> list[tuple[str, str]]:
    return [(c.method, c.request.model_name) for c in server.service.calls]


def test_chunked_choice_uses_each_models_d(small_and_big: FakeServer) -> None:
    with sync_client(small_and_big, chunked_threshold_bytes=THRESHOLD) as client:
        big = client.embed(BIG_IDS, model="big")
        small = client.embed(BIG_IDS)  # must not go chunked because "big" would
        client.embed(BIG_IDS, model="big")
        client.embed(BIG_IDS)
    assert calls(small_and_big) == expected_calls()
    assert big.shape == (1, 100, 4096)
    assert np.array_equal(small, rows(BIG_IDS, D))


def test_chunked_choice_uses_each_models_d_small_first(small_and_big: FakeServer) -> None:
    with sync_client(small_and_big, chunked_threshold_bytes=THRESHOLD) as client:
        client.embed(BIG_IDS)
        big = client.embed_result(BIG_IDS, model="big")  # goes chunked on its own D
    assert [m for m, _ in calls(small_and_big)] == [
        "GetModelInfo",
        "Embed",
        "GetModelInfo",
        "EmbedChunked",
    ]
    assert big.model_name == "big"
    assert big.hidden_states.flags.writeable  # assembled from chunks


def test_info_teaches_the_client_a_models_d(small_and_big: FakeServer) -> None:
    with sync_client(small_and_big, chunked_threshold_bytes=THRESHOLD) as client:
        assert client.info("big").d_model == 4096
        client.embed(BIG_IDS, model="big")
    assert [m for m, _ in calls(small_and_big)] == ["GetModelInfo", "EmbedChunked"]


# ---------------------------------------------------------------- the asyncio client


def test_async_per_call_model_unary_chunked_and_stream(two: FakeServer) -> None:
    async def main() -> tuple[Any, ...]:
        async with async_client(two, chunked_threshold_bytes=None) as client:
            unary = await client.embed(IDS, model=DEC)
            result = await client.embed_result(IDS, model=DEC)
            default = await client.embed(IDS)
            stream = [hs async for hs in client.embed_stream([[[1]], [[2]]], model=DEC)]
            results = [r async for r in client.embed_stream_results([[[1]]], model=DEC)]
        async with async_client(two, chunked_threshold_bytes=0, model_name=DEC) as client:
            chunked = await client.embed(IDS)
            chunked_default = await client.embed(IDS, model="")
        return unary, result, default, stream, results, chunked, chunked_default

    unary, result, default, stream, results, chunked, chunked_default = run(main())
    assert sent(two, "Embed") == [DEC, DEC, ""]
    assert sent(two, "EmbedStream.item") == [DEC, DEC, DEC]
    assert sent(two, "EmbedChunked") == [DEC, ""]
    assert np.array_equal(unary, rows(IDS, D_DEC))
    assert result.model_name == DEC
    assert default.shape == (1, 3, D)
    assert [s.shape for s in stream] == [(1, 1, D_DEC)] * 2
    assert results[0].model_name == DEC
    assert np.array_equal(chunked, rows(IDS, D_DEC))
    assert chunked_default.shape == (1, 3, D)


def test_async_info_and_models(two: FakeServer) -> None:
    async def main() -> tuple[ModelInfo, ModelInfo, ModelInfo, ModelList]:
        async with async_client(two) as client:
            return (
                await client.info(DEC),
                await client.info(),
                await client.model_info(model=DEC),
                await client.models(),
            )

    dec, default, old_name, served = run(main())
    assert sent(two, "GetModelInfo") == [DEC, "", DEC]
    assert (dec.d_model, default.d_model, old_name) == (D_DEC, D, dec)
    assert served.names == (FAKE_NAME, DEC)
    assert served.default_model == FAKE_NAME
    assert AsyncEmbeddingClient.model_info is AsyncEmbeddingClient.info


def test_async_unknown_model(two: FakeServer) -> None:
    async def main() -> list[BaseException]:
        errors: list[BaseException] = []
        async with async_client(two) as client:
            for pending in (client.embed(IDS, model="nope"), client.info("nope")):
                try:
                    await pending
                except ModelNotFoundError as exc:
                    errors.append(exc)
            async for item in client.embed_stream_results(
                [[[1]]], model="nope", return_exceptions=True
            ):
                assert isinstance(item, BaseException)
                errors.append(item)
        return errors

    errors = run(main())
    assert len(errors) == 3
    assert all(isinstance(e, ModelNotFoundError) and "'nope'" in str(e) for e in errors)


def test_async_chunked_choice_uses_each_models_d(small_and_big: FakeServer) -> None:
    async def main() -> None:
        async with async_client(small_and_big, chunked_threshold_bytes=THRESHOLD) as client:
            await client.embed(BIG_IDS, model="big")
            small = await client.embed(BIG_IDS)
            assert small.shape == (1, 100, D)
            await client.embed(BIG_IDS, model="big")
            await client.embed(BIG_IDS)

    run(main())
    assert calls(small_and_big) == expected_calls()


# ---------------------------------------------------------------- the command line


@pytest.fixture
def out(capsys: pytest.CaptureFixture[str]) -> Callable[[], str]:
    """What the CLI printed since the last call."""
    return lambda: capsys.readouterr().out


def test_cli_embed_model(two: FakeServer, out: Callable[[], str]) -> None:
    assert main(["embed", "--target", two.address, "--ids", "1 2 3", "--model", DEC]) == 0
    first = out().splitlines()[0]
    assert first == f"hidden_states [1, 3, {D_DEC}] float32, model {DEC} 7"
    assert main(["embed", "--target", two.address, "--ids", "1 2 3"]) == 0
    assert out().splitlines()[0].startswith(f"hidden_states [1, 3, {D}] float32, model {FAKE_NAME}")
    assert sent(two, "Embed") == [DEC, ""]


def test_cli_info_model_and_backend(two: FakeServer, out: Callable[[], str]) -> None:
    assert main(["info", "--target", two.address, "--model", DEC]) == 0
    text = out()
    assert f"model              {DEC} 7" in text
    assert f"d_model (D)        {D_DEC}" in text
    assert "backend            onnxruntime" in text
    assert main(["info", "--target", two.address]) == 0
    assert "backend            table" in out()
    assert main(["info", "--target", two.address, "--model", DEC, "--json"]) == 0
    assert json.loads(out())["backend"] == "onnxruntime"
    assert sent(two, "GetModelInfo") == [DEC, "", DEC]


def test_cli_info_all(two: FakeServer, out: Callable[[], str]) -> None:
    assert main(["info", "--target", two.address, "--all"]) == 0
    blocks = out().strip().split("\n\n")
    assert [b.splitlines()[0] for b in blocks] == [
        f"model              {FAKE_NAME} 7 (default)",
        f"model              {DEC} 7",
    ]
    assert f"d_model (D)        {D_DEC}" in blocks[1]
    assert main(["info", "--target", two.address, "--all", "--json"]) == 0
    listed = json.loads(out())
    assert listed["default_model"] == FAKE_NAME
    assert [(m["name"], m["d_model"]) for m in listed["models"]] == [(FAKE_NAME, D), (DEC, D_DEC)]
    assert two.service.count("ListModels") == 2


def test_cli_unknown_model_is_one_line(two: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["embed", "--target", two.address, "--ids", "1", "--model", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("tokembed embed: error: NOT_FOUND")
    assert "'nope' is not served here" in err[0]
    with pytest.raises(SystemExit):  # --all and --model exclude each other
        main(["info", "--target", two.address, "--all", "--model", DEC])
