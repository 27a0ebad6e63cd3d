"""Process-wide allocator tuning for large responses (glibc only).

Every large response is a fresh allocation (the look-up's rows, the encoded bytes,
gRPC's copy of them). glibc serves blocks above its mmap threshold (at most 32 MiB,
dynamically) with fresh mmap'd pages, which the kernel zero-fills as they are first
touched. Three levers, measured on one [32,512] x 512 float32 answer (33.5 MB):

- **Huge pages for malloc's mapped blocks** (the default): faulted in 2 MiB at a time
  instead of 4 KiB, building the answer's bytes takes ~5 ms instead of ~19, and the
  server's CPU per large unary answer fell from ~85-130 to ~50-60 ms. glibc reads
  ``GLIBC_TUNABLES`` only when a process starts, so ``tokembed serve`` restarts itself
  once (``execve``: the same pid and command line) with ``glibc.malloc.hugetlb=1``
  added. numpy already asks for huge pages for its own large arrays, which is why the
  rows were never the slow copy. Resident memory at idle: +2 MB.
- **A high mmap threshold** (opt-in, --malloc-mmap-threshold-bytes): freed blocks stay in
  the heap for the next response (~2.7 ms to build the bytes), but memory freed after a
  peak stays with the process (admission bounds that peak).
- **One malloc arena for all threads** (always): lower resident memory, no measurable
  cost (see tune_malloc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
TRIM_KEEP_BYTES = 128 * 1024 * 1024
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb"
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def environ_with_huge_page_malloc(
    environ: Mapping[str, str], thp_mode_file: Path = THP_MODE_FILE
) -> dict[str, str] | None:
    """The environment to restart with for huge-page malloc; None when there is no
    need (already set, by us or by the operator, who may have set it to 0) or no use
    (not glibc, or the kernel's transparent huge pages are off)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if HUGE_PAGE_TUNABLE + "=" in tunables:
        return None
    if not is_glibc() or not transparent_huge_pages_usable(thp_mode_file):
        return None
    setting = f"{HUGE_PAGE_TUNABLE}=1"
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{setting}" if tunables else setting}


def restart_with(environ: Mapping[str, str]) -> None:
    """Replace this process with the same command line under ``environ`` (same pid, so
    supervisors, signals and the bench's meters follow it). Returns only if that fails
    (an embedded interpreter without an executable, say): then the process goes on as
    it is, without the tuning."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, dict(environ))
    except OSError as exc:
        logger.warning("could not restart for huge-page malloc (%s); going on without", exc)


def is_glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):
        return False


def transparent_huge_pages_usable(mode_file: Path = THP_MODE_FILE) -> bool:
    """True unless the kernel says ``[never]`` (or has no THP at all)."""
    try:
        return "[never]" not in mode_file.read_text()
    except OSError:
        return False


def tune_malloc(mmap_threshold_bytes: int) -> bool:
    """One malloc arena always; the thresholds too when ``mmap_threshold_bytes`` > 0.
    False (and a debug line) where glibc is not the allocator."""
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # One arena for every thread: the look-up (compute thread), the encode (encode
    # threads) and gRPC's own threads then draw from, and return to, the same free
    # blocks. With an arena per thread each keeps its own peak: 1.1 GB resident after
    # one-at-a-time [32,512] requests with the thresholds below, against ~0.3 GB with one
    # arena; without them, one [32,512] answer peaked 20-37 MB higher and left ~33 MB
    # resident after it (measured here; no throughput change beyond this machine's noise).
    applied = bool(mallopt(_M_ARENA_MAX, 1) == 1)
    if mmap_threshold_bytes > 0:
        threshold = min(mmap_threshold_bytes, 2**31 - 1)
        applied = bool(mallopt(_M_MMAP_THRESHOLD, threshold) == 1) and applied
        applied = bool(mallopt(_M_TRIM_THRESHOLD, TRIM_KEEP_BYTES) == 1) and applied
        logger.debug("malloc mmap threshold %d bytes", threshold)
    logger.debug("malloc tuning %s", "applied" if applied else "refused")
    return applied


def _glibc_function(name: str) -> Any:
    libc = _libc()
    if libc is None:
        return None
    try:
        return getattr(libc, name)
    except AttributeError:
        logger.debug("no %s in the C library; allocator left as is", name)
        return None


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, found once: ``find_library`` runs ``ldconfig -p`` in a subprocess,
    and the heap trim asks for ``malloc_trim`` every second."""
    if not sys.platform.startswith("linux"):
        return None
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        return ctypes.CDLL(library)
    except OSError:
        logger.debug("cannot load %s; allocator left as is", library)
        return None


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``).

    Loading builds large temporary arrays (the warm-up, the float16 table); with the
    thresholds above they would stay resident for the life of the process.
    """
    trim = _glibc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))
