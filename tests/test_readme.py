"""The README says what is true: its settings table is the one Settings generates and its
links resolve. (Its console samples, and docs/client.md's, are what the commands print:
tests/test_docs_samples.py.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
