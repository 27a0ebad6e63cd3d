"""tokembed's own clients and CLI drive the model repository: the index, a load (its
config, a failure as ``ModelLoadError`` with its reason), an unload; the control token
sent in place of the data token. Against the real server in explicit mode."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokembed.cli.main import main
from tokembed.client import (
    AsyncEmbeddingClient,
    AuthenticationError,
    EmbeddingClient,
    ModelLoadError,
    ModelNotFoundError,
    RepositoryModel,
)

from support.fixtures import SMALL_D, SMALL_PAD, SMALL_SEED, SMALL_V
from support.models import export_model_dir
from support.repository import hash_mismatch, put_version

MODEL = "small"
V2_SEED = SMALL_SEED + 10
IDS = [[4, 5, 6]]


@pytest.fixture(scope="module")
def version_2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_model_dir(
        tmp_path_factory.mktemp("clients-v2") / "model",
        vocab_size=SMALL_V, d_model=SMALL_D, seed=V2_SEED, padding_idx=SMALL_PAD,
        name=MODEL, version="2",
    )  # fmt: skip


def test_the_blocking_client_indexes_loads_and_unloads(
    tmp_path: Path, small_model_dir: Path, version_2_dir: Path, start_server: Any,
    small_rows: Any,
) -> None:  # fmt: skip
    repository = tmp_path / "models"
    put_version(repository, MODEL, 1, small_model_dir)
    put_version(repository, MODEL, 2, version_2_dir)
    server = start_server((), model_repository=repository)
    with EmbeddingClient(server.target) as client:
        assert client.repository_index() == [
            RepositoryModel(MODEL, "1", "UNAVAILABLE", ""),
            RepositoryModel(MODEL, "2", "UNAVAILABLE", ""),
        ]
        client.load_model(MODEL, config={"version_policy": {"specific": {"versions": [1]}}})
        result = client.embed_result(IDS)
        assert result.model_version == "1"
        np.testing.assert_array_equal(result.hidden_states, small_rows[IDS])
        assert [m.version for m in client.repository_index(ready_only=True)] == ["1"]
        # A version 3 spoilt: the load fails with its reason; version 1 serves on.
        hash_mismatch(repository, MODEL, 3, version_2_dir)
        with pytest.raises(ModelLoadError, match=r"version 3.*sha256"):
            client.load_model(MODEL, config={"version_policy": {"latest": {"num_versions": 1}}})
        assert client.embed_result(IDS).model_version == "1"
        client.unload_model(MODEL)
        with pytest.raises(ModelNotFoundError, match="unloaded"):
            client.embed(IDS)


def test_the_asyncio_client_sends_the_control_token_in_place_of_the_data_token(
    tmp_path: Path, small_model_dir: Path, start_server: Any
) -> None:
    repository = tmp_path / "models"
    put_version(repository, MODEL, 1, small_model_dir)
    (tmp_path / "data").write_text("data-token")
    (tmp_path / "control").write_text("control-token")
    server = start_server(
        (), model_repository=repository, auth_token_file=tmp_path / "data",
        control_token_file=tmp_path / "control",
    )  # fmt: skip

    async def run() -> None:
        async with AsyncEmbeddingClient(server.target, token="data-token") as client:
            with pytest.raises(AuthenticationError, match="control token"):
                await client.load_model(MODEL)
            await client.load_model(MODEL, control_token="control-token")
            assert (await client.embed(IDS)).shape == (1, 3, SMALL_D)
            index = await client.repository_index(control_token="control-token")
            assert [(m.version, m.state) for m in index] == [("1", "READY")]
            await client.unload_model(MODEL, control_token="control-token")

    asyncio.run(run())


def test_the_cli_indexes_loads_and_unloads(
    tmp_path: Path, small_model_dir: Path, version_2_dir: Path, start_server: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    repository = tmp_path / "models"
    put_version(repository, MODEL, 1, small_model_dir)
    server = start_server((), model_repository=repository)
    target = ["--target", server.target]
    assert main(["models", "load", MODEL, *target]) == 0
    assert capsys.readouterr().out == f"loaded {MODEL}\n"
    assert main(["models", "index", *target]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "MODEL  VERSION  STATE  REASON",
        "small  1        READY",
    ]
    put_version(repository, MODEL, 2, version_2_dir)
    policy = json.dumps({"version_policy": {"all": {}}})
    assert main(["models", "load", MODEL, "--config", policy, *target]) == 0
    assert main(["models", "index", "--json", *target]) == 0
    listed = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert [(m["version"], m["state"]) for m in listed] == [("1", "READY"), ("2", "READY")]
    # A mistake is one line, not a traceback.
    assert main(["models", "load", "nope", *target]) != 0
    assert "no model 'nope' in the repository" in capsys.readouterr().err
    assert main(["models", "load", *target]) != 0
    assert "needs the model's name" in capsys.readouterr().err
    assert main(["models", "load", MODEL, "--config", "{", *target]) != 0
    assert "--config is not valid JSON" in capsys.readouterr().err
    assert main(["models", "unload", MODEL, *target]) == 0
    assert "unloading small" in capsys.readouterr().out
