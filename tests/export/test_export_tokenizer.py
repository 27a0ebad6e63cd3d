"""``tokembed export --tokenizer``: the tokenizer.json copied into the model directory,
hashed with its other files and recorded in the manifest; each mistake one line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tokembed.cli.main import main
from tokembed.export.errors import ModelDirError
from tokembed.export.model_dir import load_model_dir
from tokembed.export.staging import file_entries

from support.text_models import export_with_tokenizer


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, trained_tokenizers: dict[str, Path]) -> Path:
    return export_with_tokenizer(
        tmp_path_factory.mktemp("export") / "bpe", trained_tokenizers["bpe"], vocab_size=700,
        d_model=8, extra=("--tokenizer-max-length", "128"),
    )  # fmt: skip


def test_the_tokenizer_is_copied_hashed_and_recorded(
    exported: Path, trained_tokenizers: dict[str, Path]
) -> None:
    copied = exported / "tokenizer.json"
    assert copied.read_bytes() == trained_tokenizers["bpe"].read_bytes()
    manifest = json.loads((exported / "manifest.json").read_text())
    assert manifest["tokenizer"] == {
        "file": "tokenizer.json", "model": "BPE", "max_length": 128,
        "vocab_size": manifest["tokenizer"]["vocab_size"],
    }  # fmt: skip
    assert 0 < manifest["tokenizer"]["vocab_size"] <= 700
    entry = file_entries(exported)["tokenizer.json"]
    assert manifest["files"]["tokenizer.json"] == {
        "sha256": entry.sha256, "size_bytes": entry.size_bytes,
    }  # fmt: skip
    model = load_model_dir(exported)
    assert model.tokenizer_path == copied
    assert model.weight_bytes == sum(
        e["size_bytes"] for name, e in manifest["files"].items() if name != "tokenizer.json"
    )


def test_a_changed_tokenizer_is_refused_as_any_changed_file(exported: Path, tmp_path: Path) -> None:
    copy = tmp_path / "model"
    shutil.copytree(exported, copy)
    tokenizer = copy / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes().replace(b'"BPE"', b'"BPF"'))
    with pytest.raises(ModelDirError, match=r"tokenizer.json: sha256 is [0-9a-f]+, the manifest"):
        load_model_dir(copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["files"]["tokenizer.json"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelDirError, match=r"tokenizer.file .tokenizer.json. is not listed"):
        load_model_dir(copy)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tokenizer", "{missing}"], r"--tokenizer .*missing.json: no such file"),
        (
            ["--tokenizer", "{not_json}"],
            r"--tokenizer .*not.json: not a tokenizer.json the "
            "tokenizers library can load",
        ),
        (
            ["--tokenizer", "{bpe}", "--vocab-size", "100"],
            r"its ids reach \d+, past the "
            "table's 100 rows",
        ),
        (["--tokenizer-max-length", "8"], "--tokenizer-max-length needs --tokenizer"),
        (["--tokenizer", "{bpe}", "--tokenizer-max-length", "0"], "must be positive, got 0"),
        (["--builtin", "--tokenizer", "{bpe}"], "--builtin takes no --tokenizer"),
    ],
)
def test_mistakes_are_one_line(
    flags: list[str],
    message: str,
    tmp_path: Path,
    trained_tokenizers: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    not_json = tmp_path / "not.json"
    not_json.write_text("{}")
    paths = {"missing": tmp_path / "missing.json", "not_json": not_json,
             "bpe": trained_tokenizers["bpe"]}  # fmt: skip
    argv = ["export", "--out", str(tmp_path / "out"), "--vocab-size", "1000", "--d-model", "8"]
    if "--builtin" in flags:
        argv = ["export", "--out", str(tmp_path / "out")]
    code = main([*argv, *(flag.format(**paths) for flag in flags)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1, err
    assert err.startswith("tokembed export: error: ")
    assert re.search(message, err), err


def test_from_pretrained_brings_the_directorys_own_tokenizer(
    tmp_path: Path, trained_tokenizers: dict[str, Path]
) -> None:
    """``--from-pretrained DIR`` passes ``DIR/tokenizer.json`` through ``--tokenizer``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    saved = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=700, n_embd=8, n_layer=1, n_head=2)).save_pretrained(
        saved
    )
    shutil.copyfile(trained_tokenizers["bpe"], saved / "tokenizer.json")
    out = tmp_path / "out"
    assert main(["export", "--from-pretrained", str(saved), "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"]["model"] == "BPE"
    assert manifest["pretrained"]["architecture"] == "gpt2"
    assert (out / "tokenizer.json").read_bytes() == trained_tokenizers["bpe"].read_bytes()
    assert load_model_dir(out).tokenizer_path == out / "tokenizer.json"
