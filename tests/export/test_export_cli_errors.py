"""Every bad input to ``tokembed export`` is one line on stderr and a non-zero exit, never a
traceback, and leaves no model directory behind. The table of cases runs through ``main()``
in this process (tokembed_main: an escaping exception fails the test as a traceback would);
the tests after it run a subprocess, as users do, for what only a process shows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.no_torch import env_without_torch


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    embed = torch.randn(10, 4)
    path = tmp_path_factory.mktemp("ckpt") / "ckpt.pt"
    torch.save(
        {
            "embed.weight": embed,
            "lm_head.weight": embed,  # tied
            "proj.bias": torch.zeros(4),
            "conv.weight": torch.zeros(2, 2, 2),
            "empty.weight": torch.zeros(0, 4),
        },
        path,
    )
    return path


# (extra arguments, fragments the one line must hold); "{ckpt}" becomes the checkpoint.
CASES = {
    "missing file": (
        ["--weights", "{tmp}/nope.safetensors", "--key", "w"],
        ["checkpoint not found: ", "nope.safetensors"],
    ),
    "key not found": (
        ["--weights", "{ckpt}", "--key", "embed_tokens.weight"],
        [
            "key 'embed_tokens.weight' not found in ckpt.pt; keys holding 2-D matrices: "
            "embed.weight, empty.weight, lm_head.weight"
        ],
    ),
    "not 2-D (1-D)": (
        ["--weights", "{ckpt}", "--key", "proj.bias"],
        ["'proj.bias' in ckpt.pt has shape [4], expected a 2-D [V, D] matrix"],
    ),
    "not 2-D (3-D)": (
        ["--weights", "{ckpt}", "--key", "conv.weight"],
        ["'conv.weight' in ckpt.pt has shape [2, 2, 2], expected a 2-D [V, D] matrix"],
    ),
    "V zero": (["--vocab-size", "0"], ["--vocab-size must be positive, got 0"]),
    "V negative": (["--vocab-size", "-5"], ["--vocab-size must be positive, got -5"]),
    "D zero": (["--d-model", "0"], ["--d-model must be positive, got 0"]),
    "D negative": (["--d-model", "-3"], ["--d-model must be positive, got -3"]),
    "V zero in checkpoint": (
        ["--weights", "{ckpt}", "--key", "empty.weight"],
        ["vocab size must be positive, got 0"],
    ),
    "padding id = V": (
        ["--vocab-size", "10", "--d-model", "4", "--padding-idx", "10"],
        ["--padding-idx 10 is outside [0, 10)"],
    ),
    "padding id negative": (
        ["--vocab-size", "10", "--d-model", "4", "--padding-idx", "-1"],
        ["--padding-idx -1 is outside [0, 10)"],
    ),
    "padding id past the checkpoint": (
        ["--weights", "{ckpt}", "--key", "embed.weight", "--padding-idx", "10"],
        ["--padding-idx 10 is outside [0, 10)"],
    ),
    "checkpoint disagrees with --d-model": (
        ["--weights", "{ckpt}", "--key", "embed.weight", "--d-model", "8"],
        ["--d-model 8 disagrees with the checkpoint's 4"],
    ),
    "key without weights": (["--key", "embed.weight"], ["--key needs --weights"]),
    "weights without key": (["--weights", "{ckpt}"], ["--weights needs --key"]),
    "scale not a number": (
        ["--vocab-size", "10", "--d-model", "4", "--scale", "half"],
        ["--scale must be 'sqrt', 'none' or a positive number, got 'half'"],
    ),
    "scale zero": (
        ["--vocab-size", "10", "--d-model", "4", "--scale", "0"],
        ["--scale must be a positive number, got '0'"],
    ),
    "seed negative": (["--vocab-size", "10", "--seed", "-1"], ["--seed must be in [0, 2**64)"]),
    "seed too large": (
        ["--vocab-size", "10", "--seed", str(2**64)],
        ["--seed must be in [0, 2**64), got 18446744073709551616"],
    ),
    "table too large for memory": (
        ["--vocab-size", "10000000000", "--d-model", "100000"],
        ["cannot allocate a [10000000000, 100000] float32 table", "out of memory"],
    ),
    "unknown checkpoint type": (
        ["--weights", "{tmp}/weights.npz", "--key", "w"],
        ["unknown checkpoint type '.npz'"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line(case, ckpt, tmp_path, tokembed_main, user_error):
    extra, fragments = CASES[case]
    (tmp_path / "weights.npz").write_bytes(b"")
    out = tmp_path / "model"
    args = [a.format(ckpt=ckpt, tmp=tmp_path) for a in extra]
    proc = tokembed_main("export", "--out", out, *args)
    user_error(proc, *fragments)
    assert proc.returncode == 2
    assert not out.exists()
    # No staging directory left beside --out either.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.npz"]


def test_output_dir_not_empty_needs_force(tmp_path, tokembed_cli, user_error):
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ["export", "--out", out, "--vocab-size", "10", "--d-model", "4"]
    user_error(
        tokembed_cli(*args), f"--out {out} exists and is not empty; pass --force to overwrite"
    )
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # untouched

    proc = tokembed_cli(*args, "--force")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert {"manifest.json", "model.onnx", "model.onnx.data"} <= {p.name for p in out.iterdir()}


def test_output_path_is_a_file(tmp_path, tokembed_cli, user_error):
    target = tmp_path / "model"
    target.write_text("not a directory")
    user_error(
        tokembed_cli("export", "--out", target, "--vocab-size", "10", "--d-model", "4"),
        "exists and is not a directory",
    )
    nested = target / "model"
    user_error(
        tokembed_cli("export", "--out", nested, "--vocab-size", "10", "--d-model", "4"),
        f"--out {nested}: cannot create it",
    )


def test_without_torch_the_command_says_what_to_install(tmp_path, user_error):
    """A server-only install (tokembed[server]) has `tokembed export` but not torch."""
    out = tmp_path / "model"
    proc = subprocess.run(
        [sys.executable, "-m", "tokembed.cli", "export", "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=env_without_torch(tmp_path / "no-torch"),
    )  # fmt: skip
    user_error(proc, "tokembed export needs torch, which is not installed", "tokembed[export]")
    assert proc.returncode == 2
    assert not out.exists()


@pytest.mark.parametrize(
    "flag", [["--seed", "3"], ["--dtype", "float16"], ["--scale", "none"], ["--model-version", "2"]]
)
def test_builtin_refuses_what_would_ask_for_another_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: list[str]
) -> None:
    from tokembed.cli.main import main

    assert main(["export", "--builtin", "--out", str(tmp_path / "m"), *flag]) == 2
    error = capsys.readouterr().err.strip()
    assert error.endswith(f"--builtin takes no {flag[0]}: its model is fixed"), error
    assert not (tmp_path / "m").exists()
