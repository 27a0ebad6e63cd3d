"""Where an export may be written (torch-free, so the command line checks it first)."""

from __future__ import annotations

from pathlib import Path

from tokembed.export.errors import ExportError


def check_out_dir(out_dir: Path, force: bool) -> None:
    """An export goes into a new or empty directory, or over one with ``--force``."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"--out {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ExportError(f"--out {out_dir} exists and is not empty; pass --force to overwrite")
