"""sha256 of files, with a progress line on a terminal for large ones; and the line each
long phase of an export shows there (``phase``)."""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

_CHUNK_BYTES = 4 * 1024 * 1024
# Below this size hashing is instant and a progress line would only flicker.
_PROGRESS_MIN_BYTES = 256 * 1024 * 1024


class Progress:
    """A single self-overwriting progress line, shown only on a terminal."""

    def __init__(self, label: str, total_bytes: int, stream: TextIO | None = None) -> None:
        self._label = label
        self._total = max(total_bytes, 1)
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = self._stream.isatty() and total_bytes >= _PROGRESS_MIN_BYTES
        self._last_percent = -1

    def update(self, done_bytes: int) -> None:
        if not self._enabled:
            return
        percent = min(100, done_bytes * 100 // self._total)
        if percent != self._last_percent:
            self._last_percent = percent
            self._stream.write(f"\r{self._label}: {percent:3d}% ({done_bytes / 2**20:,.0f} MiB)")
            self._stream.flush()

    def close(self) -> None:
        if self._enabled:
            self._stream.write("\n")
            self._stream.flush()


@contextmanager
def phase(label: str, stream: TextIO | None = None) -> Iterator[None]:
    """One line on a terminal for a phase of an export: ``label ...`` when it starts,
    completed with ``done in N s`` (or ``failed``) when it ends; nothing in pipes, logs
    or CI, as ``Progress``."""
    out = stream if stream is not None else sys.stderr
    enabled = out.isatty()
    if enabled:
        out.write(f"{label} ...")
        out.flush()
    started = time.monotonic()
    try:
        yield
    except BaseException:
        if enabled:
            out.write(" failed\n")
            out.flush()
        raise
    if enabled:
        out.write(f" done in {time.monotonic() - started:.1f} s\n")
        out.flush()


def sha256_file(path: Path, label: str | None = None) -> str:
    """Hex sha256 of a file, read in chunks so a multi-GB table needs no extra memory."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    progress = Progress(label or f"hashing {path.name}", size)
    done = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
            done += len(chunk)
            progress.update(done)
    progress.close()
    return digest.hexdigest()
