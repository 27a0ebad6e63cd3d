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
