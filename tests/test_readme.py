"""The README says what is true: its settings table is the one Settings generates, its
links resolve, and its example output is what the default model answers."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _load_script(name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_settings_table_matches_the_settings_object() -> None:
    table = _load_script("settings_table").settings_table()  # type: ignore[attr-defined]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert table in readme, "README's settings table is stale: python scripts/settings_table.py"


def test_readme_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    import re

    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to missing {target}"


def test_the_embed_example_prints_what_the_readme_and_client_guide_show(
    default_model_dir: Path, start_server: Any
) -> None:
    """`tokembed embed` on the default model, as the Quick start runs it: its output, but
    for the timings, is the README's and docs/client.md's, line for line."""
    server = start_server(default_model_dir)
    ids = "5 6 7 8 9 10 11 12"
    result = subprocess.run(
        [sys.executable, "-m", "tokembed.cli", "embed", "--target", server.target, "--ids", ids],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1].startswith("server: queue "), lines
    shown = "\n".join(lines[:-1]) + "\nserver: queue "
    for doc, command in (
        ("README.md", f'$ tokembed embed --ids "{ids}"\n'),
        ("docs/client.md", f'$ tokembed embed --target 127.0.0.1:50051 --ids "{ids}"\n'),
    ):
        text = (ROOT / doc).read_text(encoding="utf-8")
        assert command + shown in text, f"{doc} shows another output of {command.strip()}"
