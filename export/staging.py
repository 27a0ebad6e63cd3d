"""Writing a model directory safely: staged beside its destination, moved in when complete.

Shared by the exporter (torch) and the built-in default model (no torch); imports neither
torch nor onnx. A reader never sees a manifest describing files that are not (or no
longer) there, and a failed build never leaves a half-written directory behind.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import platform
import secrets
from importlib import metadata
from pathlib import Path

from tokembed import __version__
from tokembed.export.errors import ExportError
from tokembed.export.hashing import sha256_file
from tokembed.export.manifest import MANIFEST_NAME, MODEL_NAME, FileEntry


def make_staging_dir(out_dir: Path, label: str | None = None) -> Path:
    """A new empty directory beside ``out_dir`` (same file system, so a rename moves it).
    ``label`` names ``out_dir`` in the error (default: as the --out flag)."""
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        # mkdir, not tempfile.mkdtemp: its 0700 mode would stay with a directory that is
        # renamed into place; this one gets the umask's mode, as a plain mkdir would.
        staging = out_dir.parent / f".{out_dir.name}.staging-{secrets.token_hex(8)}"
        staging.mkdir()
        return staging
    except OSError as exc:
        # e.g. a parent of --out is a file, or not writable: a bad input, not a bug.
        reason = f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else exc
        where = label if label is not None else f"--out {out_dir}"
        raise ExportError(f"{where}: cannot create it ({reason})") from exc


def file_entries(directory: Path) -> dict[str, FileEntry]:
    """sha256 and size of every file in ``directory`` (written before the manifest)."""
    return {
        path.name: FileEntry(sha256=sha256_file(path), size_bytes=path.stat().st_size)
        for path in sorted(directory.iterdir())
    }


def producer_versions(packages: tuple[str, ...]) -> dict[str, str]:
    """tokembed's and Python's versions, and those of ``packages`` that are installed."""
    versions = {"tokembed": __version__, "python": platform.python_version()}
    for package in packages:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return versions


def move_into_place(staging: Path, out_dir: Path) -> None:
    """Move the staged files into ``out_dir``, replacing a previous model there (--force)
    and keeping the user's other files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # The manifest goes last and our old files go first: a reader never sees a manifest
    # that describes files not yet (or no longer) there.
    old_manifest = out_dir / MANIFEST_NAME
    stale = _listed_in(old_manifest)
    if old_manifest.exists():
        old_manifest.unlink()
    for path in [*out_dir.glob(f"{MODEL_NAME}*"), *stale]:
        path.unlink(missing_ok=True)
    for path in sorted(staging.iterdir(), key=lambda p: p.name == MANIFEST_NAME):
        os.replace(path, out_dir / path.name)


def _listed_in(manifest: Path) -> list[Path]:
    """The files a previous export's manifest lists beside it (a model directory may hold
    more than its graph); none when there is no manifest, or it cannot be read."""
    try:
        files = json.loads(manifest.read_text(encoding="utf-8")).get("files")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return []
    if not isinstance(files, dict):
        return []
    # Only plain names: a manifest is data, and never names a file outside its directory.
    names = [name for name in files if isinstance(name, str) and name == Path(name).name]
    return [manifest.parent / name for name in names if name not in ("", ".", "..")]


def publish_new(staging: Path, out_dir: Path) -> bool:
    """Rename the whole staged directory to ``out_dir`` in one step, if ``out_dir`` is
    missing or empty. Returns False, leaving ``staging`` where it is, when ``out_dir``
    already has content: another process got there first.

    One rename, not a file-by-file move: when two processes build the same directory at
    once, each file-by-file move would delete the other's files while a reader checks them.
    """
    try:
        os.rename(staging, out_dir)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    return True
