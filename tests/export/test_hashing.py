"""sha256 of files in chunks, and the progress line shown only on a terminal."""

from __future__ import annotations

import hashlib
import io

from tokembed.export.hashing import Progress, sha256_file

GIB = 2**30


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_writes_on_a_terminal():
    stream = FakeTerminal()
    progress = Progress("hashing model.bin", GIB, stream=stream)
    for done in (0, GIB // 4, GIB // 4 + 1, GIB // 2, GIB):
        progress.update(done)
    progress.close()
    text = stream.getvalue()
    # One self-overwriting line: carriage returns between updates, one newline at the end.
    assert text.endswith("\n") and text.count("\n") == 1
    frames = text.rstrip("\n").split("\r")[1:]
    assert frames == [
        "hashing model.bin:   0% (0 MiB)",
        "hashing model.bin:  25% (256 MiB)",  # 25% + 1 byte is still 25%: not rewritten
        "hashing model.bin:  50% (512 MiB)",
        "hashing model.bin: 100% (1,024 MiB)",
    ]


def test_progress_is_silent_off_a_terminal():
    stream = io.StringIO()  # a pipe or a log file: isatty() is False
    progress = Progress("hashing model.bin", GIB, stream=stream)
    progress.update(GIB // 2)
    progress.close()
    assert stream.getvalue() == ""


def test_progress_is_silent_for_small_files():
    stream = FakeTerminal()
    progress = Progress("hashing small.bin", 1024, stream=stream)
    progress.update(1024)
    progress.close()
    assert stream.getvalue() == ""


def test_sha256_file_matches_hashlib(tmp_path):
    path = tmp_path / "blob"
    # Not a multiple of the read chunk, so the last partial chunk counts too.
    data = bytes(range(256)) * (5 * 2**20 // 256) + b"tail"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert sha256_file(empty) == hashlib.sha256(b"").hexdigest()
