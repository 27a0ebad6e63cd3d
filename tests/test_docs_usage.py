"""docs/export.md shows what ``tokembed export --help`` prints: its usage block, and a
table row for every option."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPORT_DOC = ROOT / "docs" / "export.md"


def _export_help() -> str:
    result = subprocess.run(
        [sys.executable, "-m", "tokembed.cli", "export", "--help"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "100"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def _words(text: str) -> str:
    """Text with its line breaks and indents as single spaces: argparse wraps the usage to
    the terminal's width, which the page need not share."""
    return " ".join(text.split())


def test_the_usage_block_is_the_real_usage() -> None:
    usage = _export_help().split("\n\n", 1)[0]
    assert usage.startswith("usage: tokembed export ")
    doc = EXPORT_DOC.read_text(encoding="utf-8")
    section = doc.split("## Usage", 1)[1]
    block = re.search(r"```\n(usage: .*?)\n```", section, re.DOTALL)
    assert block is not None, "docs/export.md's Usage section has no usage block"
    assert _words(block.group(1)) == _words(usage), (
        "docs/export.md's usage block is stale: paste `COLUMNS=100 tokembed export --help`'s usage"
    )


def test_every_option_has_a_row_in_the_flag_table() -> None:
    options = set(re.findall(r"^  (--[a-z-]+)", _export_help(), re.MULTILINE))
    assert {"--out", "--weights", "--builtin"} <= options
    doc = EXPORT_DOC.read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `(--[a-z-]+)", doc, re.MULTILINE))
    assert options - {"--help"} <= rows, f"no row in docs/export.md for {options - rows}"


def _samples_after(doc: str, heading: str, count: int) -> list[str]:
    """The first ``count`` fenced blocks after ``heading``, each stripped."""
    section = doc.split(heading, 1)[1]
    return [b.strip() for b in re.findall(r"```\n(.*?)\n```", section, re.DOTALL)[:count]]


def test_what_a_successful_export_prints_is_what_the_page_shows(tmp_path: Path) -> None:
    """The page's success sample (the default export, to models/demo) and its tie line, as
    the command prints them: the first line on stdout, a tie's second; nothing on stderr."""
    import torch
    from safetensors.torch import save_file

    doc = EXPORT_DOC.read_text(encoding="utf-8")
    first, tie = _samples_after(doc, "On success it exits 0", 2)
    out = tmp_path / "models" / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "tokembed.cli", "export", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.replace(str(out), "models/demo").splitlines() == [first]

    weights = tmp_path / "model.safetensors"
    save_file({"model.embed_tokens.weight": torch.randn(20, 8),
               "lm_head.weight": torch.randn(20, 8)}, str(weights))  # fmt: skip
    flags = ["--key", "model.embed_tokens.weight", "--output-projection", "lm_head.weight"]
    done = subprocess.run(
        [sys.executable, "-m", "tokembed.cli", "export", "--out", str(tmp_path / "tied"),
         "--weights", str(weights), *flags],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("exported tied v1: V=20 D=8 ")
    assert lines[1] == tie
