"""Handing freed heap memory back to the OS, periodically (glibc ``malloc_trim``).

Large answers are large allocations (their response bytes, gRPC's copy of them); once
freed, glibc keeps some of what they used in its heap. Trimmed every second, resident
memory follows what is live rather than the highest peak of answers in flight ever seen
(bounded by admission, but hiding what is live); trimmed less often, a soak's resident
memory swung from one window to the next.

Everything else about the allocator is deployment configuration, read by glibc at
start-up from the environment: the Dockerfiles and the Kubernetes manifest set it, and
docs/deployment.md gives the figures.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the OS; False where glibc is not the allocator."""
    trim = _malloc_trim()
    if trim is None:
        return False
    return bool(trim(0))


async def trim_forever(interval_s: float) -> None:
    """``release_free_memory`` every ``interval_s``, off the event loop (it walks the
    heap)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval_s)
        try:
            await loop.run_in_executor(None, release_free_memory)
        except Exception:  # one failed trim must not end trimming for good
            logger.exception("releasing free memory failed; trying again next time")


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, found once (``find_library`` runs ``ldconfig -p`` in a
    subprocess), or None."""
    if not sys.platform.startswith("linux"):
        return None
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        trim = ctypes.CDLL(library).malloc_trim
    except (OSError, AttributeError):
        logger.debug("no malloc_trim in %s; memory is not trimmed", library)
        return None
    trim.argtypes = [ctypes.c_size_t]
    return trim
