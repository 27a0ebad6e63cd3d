"""``python -m tokembed.bench.nearest_heads``: the head's two CPU multiplies timed in
process, on a tiny model with a head: every figure printed, and a model without a head
refused in one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tokembed.bench import nearest_heads
from tokembed.export.head import add_head

from support.models import export_model_dir


def test_both_heads_are_timed_and_what_the_session_holds_is_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = export_model_dir(tmp_path / "m", vocab_size=200, d_model=8, dtype="bfloat16")
    add_head(directory, output_table=None, output_key=None, norm=None)
    assert nearest_heads.main([str(directory), "--turns", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"table 0 MiB \(bfloat16\); the graph's session holds -?\d+ MiB more", out)
    for case in ("one vector", "16 x 8 in one batch"):
        assert re.search(rf"{case}: numpy [\d.]+ ms, onnxruntime [\d.]+ ms, onnxruntime / "
                         r"numpy [\d.]+", out), out  # fmt: skip


def test_a_model_without_a_head_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = export_model_dir(tmp_path / "plain", vocab_size=50, d_model=8)
    with pytest.raises(SystemExit):
        nearest_heads.main([str(directory)])
    assert "has no head" in capsys.readouterr().err
