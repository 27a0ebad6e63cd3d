"""``tokembed embed --output FILE``: the answer saved as ``.npy``, loadable without pickle,
against the real server; a path that cannot be written is one line."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tokembed.cli.main import main
from tokembed.client import EmbeddingClient

from support.fixtures import SMALL_D
from support.server import ServerThread


def embed(server: ServerThread, *args: str) -> int:
    return main(["embed", "--target", server.target, *args])


def test_the_answer_is_saved_exactly(
    real_server: ServerThread,
    small_rows: np.ndarray,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "hidden.npy"
    assert embed(real_server, "--ids", "5 6 7; 8", "--output", str(out)) == 0
    printed = capsys.readouterr().out.splitlines()
    saved = np.load(out)  # allow_pickle=False, numpy's default
    assert saved.dtype == np.float32 and saved.shape == (2, 3, SMALL_D)
    np.testing.assert_array_equal(saved[0], small_rows[[5, 6, 7]])
    np.testing.assert_array_equal(saved[1, 0], small_rows[8])
    assert printed[0] == f"hidden_states [2, 3, {SMALL_D}] float32, model small 1"
    assert printed[1] == "lengths [3, 1]"
    assert printed[2] == f"saved to {out}"
    assert printed[3].startswith("server: queue ")

    flat = tmp_path / "flat.npy"
    assert embed(real_server, "--ids", "5 6 7; 8", "--layout", "flat", "--dtype", "float16",
                 "--output", str(flat)) == 0  # fmt: skip
    np.testing.assert_array_equal(np.load(flat), small_rows[[5, 6, 7, 8]].astype(np.float16))


def test_the_file_is_the_one_named(real_server: ServerThread, tmp_path: Path) -> None:
    """numpy's np.save(path) adds ".npy" to a name without it; the command writes the name
    it was given."""
    out = tmp_path / "answer.bin"
    assert embed(real_server, "--ids", "5", "--output", str(out)) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["answer.bin"]
    assert np.load(out).shape == (1, 1, SMALL_D)


def test_bfloat16_is_saved_as_its_bits_and_says_how_to_load_it(
    real_server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "half.npy"
    assert embed(real_server, "--ids", "5 6 7 8", "--dtype", "bfloat16", "--output", str(out)) == 0
    printed = capsys.readouterr().out
    saved = np.load(out)  # no pickle: a plain uint16 array
    assert saved.dtype == np.uint16 and saved.shape == (1, 4, SMALL_D)
    with EmbeddingClient(real_server.target) as client:
        want = client.embed([[5, 6, 7, 8]], "bfloat16")
    np.testing.assert_array_equal(
        saved.view(ml_dtypes.bfloat16).view(np.uint16), want.view(np.uint16)
    )
    assert f"saved to {out} as uint16, bfloat16's bits" in printed
    assert ".view(ml_dtypes.bfloat16)" in printed


@pytest.mark.parametrize("where", ["missing", "directory"])
def test_a_path_that_cannot_be_written_is_one_line(
    real_server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    out = tmp_path / "no" / "such" / "dir.npy" if where == "missing" else tmp_path
    assert embed(real_server, "--ids", "5 6", "--output", str(out)) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    assert lines[0].startswith(f"tokembed embed: error: cannot write --output {out}: ")
    assert "Traceback" not in captured.err + captured.out
