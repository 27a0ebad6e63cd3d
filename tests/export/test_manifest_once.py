"""The manifest is written once: what an export adds beside the model (the head, the
tokenizer, ``--from-pretrained``'s record) is staged with it, so the directory is in place
only with its complete manifest, and an export that fails in one of them leaves nothing
(or the model it would have replaced) behind.

A server polling its model repository reads a version once its manifest is complete and
its hashes match: a manifest rewritten after the move would have it load the model twice,
once without its head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from tokembed.cli.main import main
from tokembed.export import builtin, pipeline
from tokembed.export.builtin import BuiltinSpec
from tokembed.export.model_dir import load_model_dir


class _Published:
    """The manifest as a reader finds it the moment the directory is moved into place."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[bytes] = []
        real_move = pipeline.move_into_place

        def move_into_place(staging: Path, out_dir: Path) -> None:
            real_move(staging, out_dir)
            self.seen.append((out_dir / "manifest.json").read_bytes())

        monkeypatch.setattr(pipeline, "move_into_place", move_into_place)
        real_publish = builtin.publish_new

        def publish_new(staging: Path, out_dir: Path) -> bool:
            published = real_publish(staging, out_dir)
            self.seen.append((out_dir / "manifest.json").read_bytes())
            return published

        monkeypatch.setattr(builtin, "publish_new", publish_new)

    def only(self, out: Path) -> dict[str, Any]:
        """The one manifest published, which is still the one there."""
        assert len(self.seen) == 1
        assert (out / "manifest.json").read_bytes() == self.seen[0]
        load_model_dir(out)  # every file it lists is there, with its hash
        manifest: dict[str, Any] = json.loads(self.seen[0])
        return manifest


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> _Published:
    return _Published(monkeypatch)


def test_a_random_model_with_its_head_and_tokenizer(
    tmp_path: Path, published: _Published, trained_tokenizers: dict[str, Path]
) -> None:
    out = tmp_path / "m"
    argv = ["export", "--out", str(out), "--vocab-size", "1000", "--d-model", "8",
            "--tied-head", "--tokenizer", str(trained_tokenizers["bpe"])]  # fmt: skip
    assert main(argv) == 0
    manifest = published.only(out)
    assert manifest["head"]["table"] == "embedding"
    assert manifest["tokenizer"]["file"] == "tokenizer.json"
    assert {"head.onnx", "tokenizer.json"} <= set(manifest["files"])


def test_from_pretrained_with_its_record_head_and_tokenizer(
    tmp_path: Path, published: _Published, trained_tokenizers: dict[str, Path]
) -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=1000, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    checkpoint = tmp_path / "gpt2"
    GPT2LMHeadModel(config).save_pretrained(checkpoint)
    (checkpoint / "tokenizer.json").write_bytes(trained_tokenizers["bpe"].read_bytes())
    out = tmp_path / "m"
    assert main(["export", "--from-pretrained", str(checkpoint), "--out", str(out)]) == 0
    manifest = published.only(out)
    assert manifest["pretrained"]["architecture"] == "gpt2"
    assert manifest["head"]["table"] == "embedding" and manifest["head"]["norm"]["kind"] == (
        "layernorm"
    )
    assert manifest["tokenizer"]["file"] == "tokenizer.json"


def test_the_builtin_model_with_its_head(
    tmp_path: Path, published: _Published, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A small built-in model: the command builds DEFAULT, the same code at any size.
    small = BuiltinSpec(vocab_size=300, d_model=16)
    monkeypatch.setattr(builtin, "DEFAULT", small)
    real_build = builtin.build_builtin_model
    monkeypatch.setattr(builtin, "build_builtin_model",
                        lambda out, additions=(): real_build(out, small, additions))  # fmt: skip
    out = tmp_path / "m"
    assert main(["export", "--builtin", "--tied-head", "--out", str(out)]) == 0
    manifest = published.only(out)
    assert manifest["vocab_size"] == 300 and manifest["head"]["table"] == "embedding"


def test_an_export_that_fails_in_an_addition_leaves_nothing(
    tmp_path: Path, trained_tokenizers: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A tokenizer whose ids reach past the table is refused after the graph is proven:
    nothing is published, and a model that ``--force`` would have replaced stays whole."""
    too_small = ["--vocab-size", "100", "--d-model", "8", "--tokenizer",
                 str(trained_tokenizers["bpe"])]  # fmt: skip
    out = tmp_path / "new"
    assert main(["export", "--out", str(out), *too_small]) == 2
    assert "past the table's 100 rows" in capsys.readouterr().err
    assert not out.exists()

    kept = tmp_path / "kept"
    assert main(["export", "--out", str(kept), "--vocab-size", "64", "--d-model", "8"]) == 0
    before = {path.name: path.read_bytes() for path in kept.iterdir()}
    assert main(["export", "--out", str(kept), "--force", *too_small]) == 2
    assert {path.name: path.read_bytes() for path in kept.iterdir()} == before
    assert not [path for path in tmp_path.iterdir() if "staging" in path.name]
