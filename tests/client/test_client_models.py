"""Several models behind one real server: the per-call ``model=``, ``info(model=)``,
``models()`` and each model's own D in the chunked choice, for both clients and the CLI.

The server serves "small" (the default: V=1000, D=64, padding id 0, on onnxruntime here) and
"decoder" (V=400, D=24, no padding id, from its table): an answer's width and values tell
which model made it, and the server's per-model request counts which model was asked.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import FrozenInstanceError
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from client_support import (
    DECODER_NAME,
    SMALL_NAME,
    LoadingServer,
    async_client_for,
    client_for,
    requests_of,
)

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

from support.fixtures import DECODER_D, DECODER_V, SMALL_D, SMALL_V
from support.server import ServerThread, wait_for

T = TypeVar("T")
DEC = DECODER_NAME
IDS = [[1, 2, 3]]
VERSION = "1"  # what support.models exports every model as
SERVED = f"(this server serves '{SMALL_NAME}', '{DEC}')"


@pytest.fixture
def two(
    start_server: Callable[..., ServerThread], small_model_dir: Path, decoder_model_dir: Path
) -> ServerThread:
    # Tables of at most 100 kB: the decoder's (38 kB) is one, the small model's (256 kB) is
    # not, so that it runs on onnxruntime and each model reports its own backend.
    return start_server((small_model_dir, decoder_model_dir), float32_table_max_bytes=100_000)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


def asked(server: ServerThread, method: str) -> dict[str, int]:
    """How many ``method`` requests each model answered (the counts the server keeps)."""
    return {model: requests_of(server, method, model=model) for model in (SMALL_NAME, DEC)}


# ---------------------------------------------------------------- per-call model, sync


def test_per_call_model_reaches_the_server_unary(
    two: ServerThread, small_rows: np.ndarray, decoder_rows: np.ndarray
) -> None:
    with client_for(two, chunked_threshold_bytes=None) as client:
        dec = client.embed(IDS, model=DEC)
        default = client.embed(IDS)
        result = client.embed_result(IDS, model=DEC)
    assert asked(two, "Embed") == {SMALL_NAME: 1, DEC: 2}
    assert dec.shape == (1, 3, DECODER_D)
    np.testing.assert_array_equal(dec, decoder_rows[IDS])
    np.testing.assert_array_equal(default, small_rows[IDS])
    assert result.model_name == DEC
    np.testing.assert_array_equal(result.hidden_states, decoder_rows[IDS])


def test_per_call_model_overrides_the_clients_model_name(
    two: ServerThread, small_rows: np.ndarray, decoder_rows: np.ndarray
) -> None:
    with client_for(two, model_name=DEC, chunked_threshold_bytes=None) as client:
        mine = client.embed(IDS)  # the client's model_name
        named = client.embed(IDS, model=SMALL_NAME)
        default = client.embed(IDS, model="")  # "": the server's default, not the client's
    np.testing.assert_array_equal(mine, decoder_rows[IDS])
    np.testing.assert_array_equal(named, small_rows[IDS])
    np.testing.assert_array_equal(default, small_rows[IDS])
    assert asked(two, "Embed") == {SMALL_NAME: 2, DEC: 1}


def test_per_call_model_on_the_chunked_path(two: ServerThread, decoder_rows: np.ndarray) -> None:
    with client_for(two, chunked_threshold_bytes=0) as client:
        hs = client.embed(IDS, model=DEC)  # its D learnt from this (unary) answer
        result = client.embed_result(IDS, model=DEC)
        again = client.embed(IDS, model=DEC)
    np.testing.assert_array_equal(hs, decoder_rows[IDS])
    assert result.model_name == DEC
    np.testing.assert_array_equal(result.hidden_states, decoder_rows[IDS])
    np.testing.assert_array_equal(again, decoder_rows[IDS])
    assert wait_for(lambda: asked(two, "EmbedChunked") == {SMALL_NAME: 0, DEC: 2}, 10)
    assert asked(two, "Embed") == {SMALL_NAME: 0, DEC: 1}
    assert asked(two, "GetModelInfo") == {SMALL_NAME: 0, DEC: 0}


def test_per_call_model_on_the_stream(
    two: ServerThread, small_rows: np.ndarray, decoder_rows: np.ndarray
) -> None:
    inputs = [[[1]], [[2, 3]]]
    with client_for(two) as client:
        arrays = list(client.embed_stream(inputs, model=DEC))
        results = list(client.embed_stream_results(inputs))
        mixed = list(client.embed_stream_results(inputs, model=DEC, return_exceptions=True))
    assert asked(two, "EmbedStream") == {SMALL_NAME: 2, DEC: 4}
    for ids, array, result, named in zip(inputs, arrays, results, mixed, strict=True):
        np.testing.assert_array_equal(array, decoder_rows[ids])
        np.testing.assert_array_equal(result.hidden_states, small_rows[ids])
        assert isinstance(named, EmbedResult) and named.model_name == DEC
        np.testing.assert_array_equal(named.hidden_states, decoder_rows[ids])


def test_model_must_be_text(two: ServerThread) -> None:
    with client_for(two) as client, pytest.raises(InvalidInputError, match="model must be"):
        client.embed(IDS, model=3)  # type: ignore[arg-type]
    assert two.metric("tokembed_requests_total") == 0  # no RPC at all


# ---------------------------------------------------------------- unknown models


def test_unknown_model_per_call_is_model_not_found(two: ServerThread) -> None:
    # Chunking on or off, the NOT_FOUND comes from the Embed itself (a model's D is learnt
    # from its first answer, so nothing is asked before the call), and is counted there.
    for count, threshold in enumerate((1024, None), start=1):
        with (
            client_for(two, chunked_threshold_bytes=threshold, retries=3) as client,
            pytest.raises(ModelNotFoundError) as info,
        ):
            client.embed(IDS, model="nope")
        assert "'nope' is not served here" in str(info.value)
        assert SERVED in info.value.details
        assert (info.value.reason, info.value.attempts) == ("not_found", 1)  # not retried
        assert requests_of(two, "Embed", code="NOT_FOUND") == count
    assert requests_of(two, "GetModelInfo") == 0


def test_unknown_model_on_the_stream(two: ServerThread) -> None:
    with client_for(two) as client:
        out = list(client.embed_stream_results([[[1]]], model="nope", return_exceptions=True))
        with pytest.raises(ModelNotFoundError, match="'nope' is not served"):
            list(client.embed_stream([[[1]]], model="nope"))
    assert isinstance(out[0], ModelNotFoundError)
    assert (out[0].code, out[0].reason) == (grpc.StatusCode.NOT_FOUND, "not_found")
    assert SERVED in str(out[0])
    assert requests_of(two, "EmbedStream", code="NOT_FOUND") == 2


def test_unknown_model_in_info(two: ServerThread) -> None:
    with client_for(two) as client, pytest.raises(ModelNotFoundError, match="not served"):
        client.info("nope")


# ---------------------------------------------------------------- info, models, sync


def test_info_names_the_model(two: ServerThread) -> None:
    with client_for(two, model_name=DEC) as client:
        dec = client.info()  # the client's model_name
        default = client.info("")
        by_name = client.info(SMALL_NAME, timeout_s=5)
        old_name = client.model_info(model=DEC)
        old_call = client.model_info(timeout_s=5)
    assert asked(two, "GetModelInfo") == {SMALL_NAME: 2, DEC: 3}
    assert (dec.name, dec.vocab_size, dec.d_model, dec.padding_id, dec.backend) == (
        DEC, DECODER_V, DECODER_D, None, "table",
    )  # fmt: skip
    assert (default.name, default.vocab_size, default.d_model, default.padding_id) == (
        SMALL_NAME, SMALL_V, SMALL_D, 0,
    )  # fmt: skip
    assert default.backend == "onnxruntime"
    assert by_name == default
    assert old_name == old_call == dec
    assert EmbeddingClient.model_info is EmbeddingClient.info  # one method, two names


def test_models_decodes_list_models(two: ServerThread) -> None:
    with client_for(two) as client:
        served = client.models()
        alone = client.info(DEC)
    assert requests_of(two, "ListModels") == 1
    assert isinstance(served, ModelList)
    assert served.default_model == SMALL_NAME
    assert served.names == (SMALL_NAME, DEC)
    assert len(served) == 2
    assert [info.d_model for info in served] == [SMALL_D, DECODER_D]
    assert served[DEC] == alone  # what GetModelInfo says of it
    assert (served[DEC].backend, served[SMALL_NAME].backend) == ("table", "onnxruntime")
    assert served[SMALL_NAME].limits.max_batch_tokens == two.settings.max_batch_tokens
    assert DEC in served and "nope" not in served
    assert served.get("nope") is None
    with pytest.raises(KeyError, match="nope"):
        served["nope"]
    with pytest.raises(FrozenInstanceError):
        served.default_model = "x"  # type: ignore[misc]


def test_models_is_retried_while_the_server_loads(loading: LoadingServer) -> None:
    server = loading.server
    with (
        client_for(server, retries=1000, backoff_s=0.01, backoff_max_s=0.05) as client,
        ThreadPoolExecutor(1) as pool,
    ):
        call = pool.submit(client.models, timeout_s=60)
        # Refused (the models are loading) and retried: a second refusal.
        assert wait_for(lambda: requests_of(server, "ListModels", code="UNAVAILABLE") >= 2, 30)
        loading.finish_loading()
        served = call.result(60)
    assert served.names == (SMALL_NAME, DEC)
    assert requests_of(server, "ListModels", code="OK") == 1


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

# [1,100] float32: 25600 bytes at the small model's D=64, 9600 at the decoder's D=24; the
# threshold lies between, so the small model's answer comes chunked and the decoder's not.
WIDE_IDS = np.arange(100).reshape(1, 100)
THRESHOLD = 16_000


def _steps(server: ServerThread) -> list[Callable[[], bool]]:
    """After each of: small, decoder, small, decoder, what the server has answered."""

    def state(chunked: int, embed_small: int, embed_dec: int) -> Callable[[], bool]:
        return lambda: (
            asked(server, "EmbedChunked") == {SMALL_NAME: chunked, DEC: 0}
            and asked(server, "GetModelInfo") == {SMALL_NAME: 0, DEC: 0}
            and asked(server, "Embed") == {SMALL_NAME: embed_small, DEC: embed_dec}
        )

    # Each model's first call is unary and teaches its D (no GetModelInfo); from then on
    # the wide request goes chunked for "small" (D=64) and stays unary for "decoder" (D=24).
    return [state(0, 1, 0), state(0, 1, 1), state(1, 1, 1), state(1, 1, 2)]


def test_chunked_choice_uses_each_models_d(
    two: ServerThread, small_rows: np.ndarray, decoder_rows: np.ndarray
) -> None:
    steps = iter(_steps(two))
    with client_for(two, chunked_threshold_bytes=THRESHOLD) as client:
        first = client.embed(WIDE_IDS)  # D unknown yet: unary, and D=64 learnt
        assert wait_for(next(steps), 10)
        client.embed(WIDE_IDS, model=DEC)
        assert wait_for(next(steps), 10)
        wide = client.embed(WIDE_IDS)  # chunked: D=64
        assert wait_for(next(steps), 10)
        narrow = client.embed(WIDE_IDS, model=DEC)  # must not go chunked because "small" did
        assert wait_for(next(steps), 10)
    np.testing.assert_array_equal(first, small_rows[WIDE_IDS])
    assert not first.flags.writeable  # a view of one unary answer
    np.testing.assert_array_equal(wide, small_rows[WIDE_IDS])
    assert wide.flags.writeable  # assembled from chunks
    np.testing.assert_array_equal(narrow, decoder_rows[WIDE_IDS])
    assert not narrow.flags.writeable  # a view of one unary answer


def test_chunked_choice_uses_each_models_d_narrow_first(
    two: ServerThread, small_rows: np.ndarray
) -> None:
    with client_for(two, chunked_threshold_bytes=THRESHOLD) as client:
        client.embed(WIDE_IDS, model=DEC)
        client.embed([[1]])  # teaches "small"'s D, not taken from "decoder"'s
        wide = client.embed_result(WIDE_IDS)  # goes chunked on its own D
    assert wide.model_name == SMALL_NAME
    assert wide.hidden_states.flags.writeable  # assembled from chunks
    np.testing.assert_array_equal(wide.hidden_states, small_rows[WIDE_IDS])
    assert wait_for(lambda: asked(two, "EmbedChunked") == {SMALL_NAME: 1, DEC: 0}, 10)
    assert asked(two, "Embed") == {SMALL_NAME: 1, DEC: 1}
    assert asked(two, "GetModelInfo") == {SMALL_NAME: 0, DEC: 0}


def test_info_teaches_the_client_a_models_d(two: ServerThread) -> None:
    with client_for(two, chunked_threshold_bytes=THRESHOLD) as client:
        assert client.info(SMALL_NAME).d_model == SMALL_D
        client.embed(WIDE_IDS, model=SMALL_NAME)
    assert wait_for(lambda: requests_of(two, "EmbedChunked") == 1, 10)
    assert requests_of(two, "GetModelInfo") == 1  # the info() call's; embed asked none


# ---------------------------------------------------------------- the asyncio client


def test_async_per_call_model_unary_chunked_and_stream(
    two: ServerThread, small_rows: np.ndarray, decoder_rows: np.ndarray
) -> None:
    async def main() -> tuple[Any, ...]:
        async with async_client_for(two, chunked_threshold_bytes=None) as client:
            unary = await client.embed(IDS, model=DEC)
            result = await client.embed_result(IDS, model=DEC)
            default = await client.embed(IDS)
            stream = [hs async for hs in client.embed_stream([[[1]], [[2]]], model=DEC)]
            results = [r async for r in client.embed_stream_results([[[1]]], model=DEC)]
        async with async_client_for(two, chunked_threshold_bytes=0, model_name=DEC) as client:
            await client.info()  # teaches the client D of the model it names
            await client.info(model="")  # and of the server's default model
            chunked = await client.embed(IDS)
            chunked_default = await client.embed(IDS, model="")
        return unary, result, default, stream, results, chunked, chunked_default

    unary, result, default, stream, results, chunked, chunked_default = run(main())
    assert asked(two, "Embed") == {SMALL_NAME: 1, DEC: 2}
    assert asked(two, "EmbedStream") == {SMALL_NAME: 0, DEC: 3}
    assert wait_for(lambda: asked(two, "EmbedChunked") == {SMALL_NAME: 1, DEC: 1}, 10)
    np.testing.assert_array_equal(unary, decoder_rows[IDS])
    assert result.model_name == DEC
    np.testing.assert_array_equal(result.hidden_states, decoder_rows[IDS])
    np.testing.assert_array_equal(default, small_rows[IDS])
    np.testing.assert_array_equal(np.concatenate(stream), decoder_rows[[[1], [2]]])
    assert results[0].model_name == DEC
    np.testing.assert_array_equal(chunked, decoder_rows[IDS])
    np.testing.assert_array_equal(chunked_default, small_rows[IDS])


def test_async_info_and_models(two: ServerThread) -> None:
    async def main() -> tuple[ModelInfo, ModelInfo, ModelInfo, ModelList]:
        async with async_client_for(two) as client:
            return (
                await client.info(DEC),
                await client.info(),
                await client.model_info(model=DEC),
                await client.models(),
            )

    dec, default, old_name, served = run(main())
    assert asked(two, "GetModelInfo") == {SMALL_NAME: 1, DEC: 2}
    assert (dec.d_model, default.d_model, old_name) == (DECODER_D, SMALL_D, dec)
    assert served.names == (SMALL_NAME, DEC)
    assert served.default_model == SMALL_NAME
    assert served[DEC] == dec
    assert AsyncEmbeddingClient.model_info is AsyncEmbeddingClient.info


def test_async_unknown_model(two: ServerThread) -> None:
    async def main() -> list[BaseException]:
        errors: list[BaseException] = []
        async with async_client_for(two) as client:
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
    for error in errors:
        assert isinstance(error, ModelNotFoundError)
        assert "'nope' is not served" in str(error) and error.reason == "not_found"


def test_async_chunked_choice_uses_each_models_d(two: ServerThread) -> None:
    steps = _steps(two)

    async def main() -> list[np.ndarray]:
        done: list[np.ndarray] = []
        async with async_client_for(two, chunked_threshold_bytes=THRESHOLD) as client:
            for step, model in zip(steps, (None, DEC, None, DEC), strict=True):
                done.append(await client.embed(WIDE_IDS, model=model))
                assert await asyncio.to_thread(wait_for, step, 10)
        return done

    first, _, wide, narrow = run(main())
    assert first.shape == (1, 100, SMALL_D) and not first.flags.writeable  # D not known yet
    assert wide.shape == (1, 100, SMALL_D) and wide.flags.writeable
    assert narrow.shape == (1, 100, DECODER_D) and not narrow.flags.writeable


# ---------------------------------------------------------------- the command line


@pytest.fixture
def out(capsys: pytest.CaptureFixture[str]) -> Callable[[], str]:
    """What the CLI printed since the last call."""
    return lambda: capsys.readouterr().out


def test_cli_embed_model(two: ServerThread, out: Callable[[], str]) -> None:
    with client_for(two) as client:
        version = client.info(DEC).version
    assert main(["embed", "--target", two.target, "--ids", "1 2 3", "--model", DEC]) == 0
    first = out().splitlines()[0]
    assert first == f"hidden_states [1, 3, {DECODER_D}] float32, model {DEC} {version}"
    assert main(["embed", "--target", two.target, "--ids", "1 2 3"]) == 0
    assert out().splitlines()[0].startswith(f"hidden_states [1, 3, {SMALL_D}] float32, model small")
    assert asked(two, "Embed") == {SMALL_NAME: 1, DEC: 1}


def test_cli_info_model_and_backend(two: ServerThread, out: Callable[[], str]) -> None:
    assert main(["info", "--target", two.target, "--model", DEC]) == 0
    text = out()
    assert f"model              {DEC} {VERSION}" in text
    assert f"d_model (D)        {DECODER_D}" in text
    assert "padding_id         none" in text
    assert "backend            table" in text
    assert main(["info", "--target", two.target]) == 0
    text = out()
    assert "backend            onnxruntime" in text
    assert "padding_id         0" in text
    assert main(["info", "--target", two.target, "--model", DEC, "--json"]) == 0
    described = json.loads(out())
    assert (described["name"], described["backend"], described["d_model"]) == (
        DEC, "table", DECODER_D,
    )  # fmt: skip
    assert asked(two, "GetModelInfo") == {SMALL_NAME: 1, DEC: 2}


def test_cli_info_all(two: ServerThread, out: Callable[[], str]) -> None:
    assert main(["info", "--target", two.target, "--all"]) == 0
    blocks = out().strip().split("\n\n")
    assert [b.splitlines()[0] for b in blocks] == [
        f"model              {SMALL_NAME} {VERSION} (default)",
        f"model              {DEC} {VERSION}",
    ]
    assert f"d_model (D)        {DECODER_D}" in blocks[1]
    assert main(["info", "--target", two.target, "--all", "--json"]) == 0
    listed = json.loads(out())
    assert listed["default_model"] == SMALL_NAME
    assert [(m["name"], m["d_model"]) for m in listed["models"]] == [
        (SMALL_NAME, SMALL_D), (DEC, DECODER_D),
    ]  # fmt: skip
    assert requests_of(two, "ListModels") == 2


def test_cli_unknown_model_is_one_line(
    two: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["embed", "--target", two.target, "--ids", "1", "--model", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("tokembed embed: error: NOT_FOUND")
    assert "'nope' is not served here" in err[0]
    with pytest.raises(SystemExit):  # --all and --model exclude each other
        main(["info", "--target", two.target, "--all", "--model", DEC])
