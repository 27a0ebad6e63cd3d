"""What ``tokembed export`` says where a newcomer trips: a model directory as ``--weights``
(the checkpoint in it is found, or the line says what to give), a key under another
prefix (the near match suggested), a bfloat16 checkpoint widened to float32 (said, naming
``--dtype bfloat16``), the long phases on a terminal (a line each, with their time), and
``export-triton``'s success line (the real version directory)."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tokembed.export.manifest import Manifest

KEY = "model.embed_tokens.weight"


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        save_file(tensors, str(path))
    else:
        torch.save(tensors, path)
    return path


@pytest.mark.parametrize(
    "name", ["model.safetensors", "pytorch_model.bin", "model.safetensors.index.json"]
)
def test_a_model_directory_as_weights_finds_its_checkpoint(name, tmp_path, tokembed_main):
    table = torch.randn(20, 8)
    directory = tmp_path / "saved"
    if name.endswith(".index.json"):
        _save(directory / "model-00001-of-00001.safetensors", {KEY: table})
        (directory / name).write_text(
            f'{{"weight_map": {{"{KEY}": "model-00001-of-00001.safetensors"}}}}'
        )
    else:
        _save(directory / name, {KEY: table})
    out = tmp_path / "out"
    proc = tokembed_main("export", "--out", out, "--weights", directory, "--key", KEY)
    assert proc.returncode == 0, proc.stderr
    assert Manifest.read(out).source["file"] == name


@pytest.mark.parametrize(
    ("files", "fragments"),
    [
        ([], ["is a directory with no checkpoint in it", "model.safetensors", "--weights"]),
        (["weights.pt"], ["is a directory with no model.safetensors", "weights.pt"]),
        (
            ["model.safetensors", "model.safetensors.index.json"],
            ["holds both model.safetensors and model.safetensors.index.json", "--weights"],
        ),
    ],
)
def test_a_directory_without_one_checkpoint_says_what_to_give(
    files, fragments, tmp_path, tokembed_main, user_error
):
    directory = tmp_path / "saved"
    directory.mkdir()
    for name in files:
        (directory / name).write_bytes(b"{}")
    proc = tokembed_main("export", "--out", tmp_path / "o", "--weights", directory, "--key", KEY)
    line = user_error(proc, *fragments)
    assert "checkpoint not found" not in line


@pytest.mark.parametrize(
    ("key", "saved", "meant"),
    [
        ("embeddings.word_embeddings.weight", "bert.embeddings.word_embeddings.weight", None),
        ("bert.embeddings.word_embeddings.weight", "embeddings.word_embeddings.weight", None),
        ("model.embed_token.weight", KEY, None),
    ],
)
def test_a_key_not_found_suggests_the_near_match(
    key, saved, meant, tmp_path, tokembed_main, user_error
):
    tensors = {saved: torch.randn(20, 8), "cls.predictions.decoder.weight": torch.randn(20, 8)}
    weights = _save(tmp_path / "model.safetensors", tensors)
    proc = tokembed_main("export", "--out", tmp_path / "o", "--weights", weights, "--key", key)
    user_error(proc, f"key {key!r} not found", f"did you mean {saved!r}?")


def test_a_bfloat16_checkpoint_widened_to_float32_says_so(tmp_path, tokembed_main):
    weights = _save(tmp_path / "m.safetensors", {KEY: torch.randn(20, 8).to(torch.bfloat16)})
    proc = tokembed_main("export", "--out", tmp_path / "wide", "--weights", weights, "--key", KEY)
    assert proc.returncode == 0, proc.stderr
    (note,) = proc.stderr.splitlines()
    assert "bfloat16" in note and "float32" in note and "--dtype bfloat16" in note
    # Asked for, either way: nothing to say.
    for dtype in ("float32", "bfloat16"):
        proc = tokembed_main("export", "--out", tmp_path / dtype, "--weights", weights,
                             "--key", KEY, "--dtype", dtype)  # fmt: skip
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def _on_a_terminal(*args: object) -> tuple[int, str]:
    """Run ``tokembed ARGS`` with stderr on a pseudo-terminal; its exit status and stderr."""
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokembed.cli", *(str(a) for a in args)],
            stdout=subprocess.DEVNULL,
            stderr=follower,
        )
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closes with the process (EIO)
                break
            if not chunk:
                break
            chunks.append(chunk)
        code = proc.wait(timeout=240)
    finally:
        os.close(leader)
    return code, b"".join(chunks).decode()


@pytest.mark.parametrize("source", ["checkpoint", "random"])
def test_long_phases_show_a_line_each_with_their_time_on_a_terminal(source, tmp_path, tokembed_cli):
    args: list[object] = ["export", "--vocab-size", "200", "--d-model", "8"]
    if source == "checkpoint":
        weights = _save(tmp_path / "m.safetensors", {KEY: torch.randn(200, 8)})
        args = ["export", "--weights", weights, "--key", KEY]
    code, err = _on_a_terminal(*args, "--out", tmp_path / "tty")
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.strip()]
    checking = [line for line in lines if line.startswith("checking the graph in onnxruntime")]
    assert len(checking) == 1 and checking[0].rstrip().endswith(" s"), lines
    first = "reading model.embed_tokens.weight" if source == "checkpoint" else "exporting"
    assert any(line.startswith(first) and " done in " in line for line in lines), lines
    # Not a terminal: nothing on stderr.
    proc = tokembed_cli(*args, "--out", tmp_path / "pipe")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_export_triton_names_the_version_directory(small_model_dir, tmp_path, tokembed_main):
    proc = tokembed_main("export-triton", small_model_dir, tmp_path / "repo", "--version", "4")
    assert proc.returncode == 0, proc.stderr
    assert "<version>" not in proc.stdout
    assert f"{tmp_path / 'repo' / 'small' / '4'}/ " in proc.stdout
