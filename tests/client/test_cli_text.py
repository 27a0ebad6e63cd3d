"""``tokembed embed --text`` and ``tokembed tokenize`` through the real dispatcher, against
the real server serving a model with its own tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokembed.cli.main import main
from tokembed.client import EmbeddingClient

from support.fixtures import TEXT_D


@pytest.fixture
def server(text_model_dir: Path, small_model_dir: Path, start_server: Any) -> Any:
    return start_server((text_model_dir, small_model_dir))


def test_embed_text_prints_the_shape_and_each_texts_ids(
    server: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with EmbeddingClient(server.target) as client:
        expected = client.embed_text(["hello world", "the fox"])
    out_file = tmp_path / "answer.npy"
    code = main([
        "embed", "--target", server.target, "--text", "hello world", "--text", "the fox",
        "--output", str(out_file),
    ])  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    tokens = int(expected.lengths.sum())
    assert out[0] == f"hidden_states [{tokens}, {TEXT_D}] float32, model text 1"
    first, second = (part.tolist() for part in np.split(expected.input_ids, [expected.lengths[0]]))
    assert out[1] == f"text 0: {len(first)} tokens {first}"
    assert out[2] == f"text 1: {len(second)} tokens {second}"
    np.testing.assert_array_equal(np.load(out_file), expected.hidden_states)


def test_tokenize_prints_ids_offsets_and_special_marks(
    server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    with EmbeddingClient(server.target) as client:
        expected = client.tokenize(["hello world"])
    assert main(["tokenize", "--target", server.target, "hello world"]) == 0
    line = capsys.readouterr().out.strip()
    ids = expected.ids()[0]
    assert line.startswith(f"text 0: {len(ids)} tokens: {ids[0]}*@0-0 ")  # [CLS], special
    assert (
        main(["tokenize", "--target", server.target, "--json", "--no-special-tokens", "a b"]) == 0
    )
    answer = json.loads(capsys.readouterr().out)
    with EmbeddingClient(server.target) as client:
        plain = client.tokenize("a b", add_special_tokens=False)
    assert answer["texts"][0]["ids"] == plain.ids()[0]
    assert answer["texts"][0]["offsets"] == [[0, 1], [2, 3]]


def test_text_errors_are_one_line(server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tokenize", "--target", server.target, "--model", "small", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model 'small' has no tokenizer" in err
    assert main(["embed", "--target", server.target, "--text", "x " * 100]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "over the model's limit of 64" in err
    assert main(["embed", "--target", server.target, "--text", "x", "--layout", "flat"]) == 2
    assert "--layout goes with --ids, not --text" in capsys.readouterr().err
