"""Row tables shared by processes: computed once, written to a cache directory, mapped.

The table backend's rows are a function of the model's files (``loading._Shared`` says
why), so every process serving a model with the same files needs the same bytes: the
workers of ``--workers N``, a restarted server, a version whose files equal another's. The
first process to need a table computes it, exactly as without the cache, and writes it to
``<table_cache_dir>/<digest>.rows`` (a temporary name, fsync, rename); every process then
maps that file read-only and serves from the mapping, so the kernel's page cache holds the
rows once for all of them. A lock file per table (``flock``) makes processes starting
together wait for the one computing instead of computing N times.

Why the checks made before a file is served are enough to never serve wrong rows:
- the directory is the server's user's alone: created 0700, and refused (each process then
  computes its own tables in memory, after one log line) when it is not a directory owned
  by that user or when group or others may write in it. So only that user (or root) can
  put a file in it or change one;
- a file reaches its final name only by a rename once it is written whole and synced, so a
  crash or a full disk leaves a temporary file, never a short one under the final name;
- what can still go wrong (a disk error, an operator truncating, copying or renaming files
  by hand) is caught by the file's exact size and its header: the format, the digest of
  everything the rows are computed from (``key``), the dtype and the shape. A file that
  fails them is removed and computed again.
Bytes changed in place by the server's own user are out of reach of any check short of
hashing every row at each start; that user can change the model's files as well.

Cleaning: after a file is written, the least recently used files (each is touched when a
process maps it) are removed until the directory holds at most ``table_cache_max_bytes``.
A process that maps a removed file keeps its mapping (the file lives until unmapped); the
next process to need it computes it again. Any file in the directory may be deleted by an
operator at any time for the same reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

FORMAT = "tokembed-rows/1"
# The rows start a page into the file, so that their mapping is page-aligned.
HEADER_BYTES = 4096
SUFFIX = ".rows"
# A temporary file this old belongs to a writer that died: the trim removes it.
_STALE_TEMPORARY_S = 3600.0

_refused: set[Path] = set()  # directories already refused (logged once per process)


class TableCache:
    """Row tables in ``directory``, at most ``max_bytes`` of them (``open`` checks it)."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes

    @classmethod
    def open(cls, directory: Path | None, max_bytes: int) -> TableCache | None:
        """The cache in ``directory`` (created 0700 if missing); None when there is no cache
        (``directory`` None) or the directory is refused, which is logged once."""
        if directory is None or max_bytes <= 0:
            return None
        refusal = _refusal(directory)
        if refusal is None:
            _refused.discard(directory)
            return cls(directory, max_bytes)
        if directory not in _refused:
            _refused.add(directory)
            logger.warning(
                "table cache %s refused: %s; each process computes and holds its own row "
                "tables", directory, refusal,
            )  # fmt: skip
        return None

    def rows(
        self,
        key: Mapping[str, object],
        shape: tuple[int, int],
        dtype: np.dtype,
        compute: Callable[[], np.ndarray | None],
    ) -> np.ndarray | None:
        """The ``[V, D]`` rows ``key`` names, mapped read-only from the cache: the file's
        when there is a valid one, else ``compute()``'s, written first (a ``compute`` that
        gives None is passed on). Rows the cache cannot hold (past ``max_bytes``, or a
        write that fails) are ``compute()``'s own, in memory."""
        digest = _digest(key)
        path = self.directory / (digest + SUFFIX)
        size = HEADER_BYTES + shape[0] * shape[1] * dtype.itemsize
        if size > self.max_bytes:
            logger.info(
                "a %s table of %d bytes is past --table-cache-max-bytes %d: held in memory",
                dtype, size, self.max_bytes,
            )  # fmt: skip
            return compute()
        found = _mapped(path, digest, shape, dtype)
        if isinstance(found, np.ndarray):
            logger.debug("table cache: %s table mapped from %s", dtype, path)
            return found
        with _locked(self.directory / (digest + ".lock")):
            found = _mapped(path, digest, shape, dtype)  # written while this one waited?
            if isinstance(found, np.ndarray):
                return found
            if found is not None:  # a file here, but not what it must be: never served
                logger.warning("table cache file %s %s: computed again", path, found)
                path.unlink(missing_ok=True)
            rows = compute()
            if rows is None:
                return None
            try:
                temporary = _write_temporary(path, _header(digest, shape, dtype), rows)
            except OSError as exc:
                logger.warning(
                    "table cache %s: cannot write %s (%s): this process holds the table in "
                    "memory", self.directory, path.name, exc.strerror or exc,
                )  # fmt: skip
                return rows
            # The rows in memory go before their file's are mapped (a load's peak is one
            # copy of the table, not two), and are mapped before the file takes its name,
            # so that nothing done to that name meanwhile can take them away.
            del rows
            written = _mapped(temporary, digest, shape, dtype)
            if not isinstance(written, np.ndarray):  # This is a bug: it was just written.
                temporary.unlink(missing_ok=True)
                raise RuntimeError(f"table cache file {temporary} unreadable: {written}")
            try:
                _publish(temporary, path)
            except OSError as exc:  # the mapping stays this process's own
                logger.warning(
                    "table cache %s: cannot name %s (%s): this process alone maps the table",
                    self.directory, path.name, exc.strerror or exc,
                )  # fmt: skip
                return written
            finally:
                temporary.unlink(missing_ok=True)  # gone once published
            logger.info("table cache: %s table computed and written to %s", dtype, path)
        self.trim(keep=path)
        return written

    def trim(self, keep: Path | None = None) -> None:
        """Remove the least recently used files until at most ``max_bytes`` remain (``keep``
        aside), and temporary files their writers left behind."""
        files: list[tuple[float, int, Path]] = []
        now = time.time()
        for path in self.directory.iterdir():
            try:
                info = path.lstat()
            except FileNotFoundError:
                continue
            if path.name.endswith(".tmp") and now - info.st_mtime > _STALE_TEMPORARY_S:
                path.unlink(missing_ok=True)
            elif path.suffix == SUFFIX and stat.S_ISREG(info.st_mode):
                files.append((info.st_mtime, info.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            if path != keep and _remove_unless_busy(path):
                total -= size
                logger.info("table cache: removed %s (least recently used)", path.name)


def _digest(key: Mapping[str, object]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _header(digest: str, shape: tuple[int, int], dtype: np.dtype) -> bytes:
    fields = {"format": FORMAT, "key": digest, "dtype": str(dtype), "shape": list(shape)}
    text = json.dumps(fields, sort_keys=True).encode()
    return text + b"\n" + bytes(HEADER_BYTES - len(text) - 1)


def _refusal(directory: Path) -> str | None:
    """Why ``directory`` cannot hold the cache (None: it can), creating it if missing."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        link = os.lstat(directory)
        info = os.stat(directory)
    except OSError as exc:
        return f"cannot create or read it ({exc.strerror or exc})"
    uid = os.geteuid()
    if link.st_uid != uid:  # a symbolic link someone else placed
        return f"it belongs to uid {link.st_uid}, not to the server's user ({uid})"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory"
    if info.st_uid != uid:
        return f"it belongs to uid {info.st_uid}, not to the server's user ({uid})"
    if info.st_mode & 0o022:
        return (
            f"group or others may write in it (mode {stat.S_IMODE(info.st_mode):o}); "
            "make it the server's user's alone (chmod 700)"
        )
    return None


def _mapped(
    path: Path, digest: str, shape: tuple[int, int], dtype: np.dtype
) -> np.ndarray | str | None:
    """The rows of ``path`` mapped read-only; None when there is no such file; what is
    wrong with it (a str) when it is not exactly what ``_header`` and the shape say."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be opened ({exc.strerror or exc})"
    try:
        info = os.fstat(fd)
        want = HEADER_BYTES + shape[0] * shape[1] * dtype.itemsize
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return "is not a regular file of the server's user"
        if info.st_size != want:
            return f"holds {info.st_size} bytes, not {want}"
        if os.pread(fd, HEADER_BYTES, 0) != _header(digest, shape, dtype):
            return "has a header that is not this table's"
        # MAP_POPULATE: the process's page tables point at the cached pages at once (its
        # first look-ups take no page faults, and its resident memory shows the table).
        view = mmap.mmap(fd, want, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                         prot=mmap.PROT_READ)  # fmt: skip
    finally:
        os.close(fd)
    # Used now: the trim removes the least recently used first (a file removed meanwhile
    # stays valid in its mapping).
    with contextlib.suppress(OSError):
        os.utime(path)
    rows = np.frombuffer(view, dtype=dtype, count=shape[0] * shape[1], offset=HEADER_BYTES)
    return rows.reshape(shape)


def _write_temporary(path: Path, header: bytes, rows: np.ndarray) -> Path:
    """``header`` and ``rows`` in a new temporary file beside ``path``, synced."""
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(header)
            out.write(np.ascontiguousarray(rows).view(np.uint8).data)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return temporary


def _publish(temporary: Path, path: Path) -> None:
    """``temporary`` renamed to ``path`` (a complete file or none under that name), the
    rename synced."""
    os.rename(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)


@contextlib.contextmanager
def _locked(lock_path: Path, *, blocking: bool = True) -> Iterator[bool]:
    """Hold ``lock_path``'s exclusive lock (yields False, holding nothing, when
    ``blocking`` is False and another process holds it). The file may be removed by a trim
    while a process waits on it: the lock is then taken again on the file the path names
    now."""
    fd = _lock_fd(lock_path, blocking)
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)


def _lock_fd(lock_path: Path, blocking: bool) -> int | None:
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            try:
                current = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if current:
            return fd
        os.close(fd)


def _remove_unless_busy(path: Path) -> bool:
    """Remove a table's file and its lock file, unless a process is computing it."""
    lock_path = path.with_suffix(".lock")
    with _locked(lock_path, blocking=False) as held:
        if not held:
            return False
        path.unlink(missing_ok=True)
        lock_path.unlink(missing_ok=True)
    return True
