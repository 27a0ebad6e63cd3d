"""CPU seconds and resident memory of another process, read from /proc (Linux)."""

from __future__ import annotations

import os
import threading
import time

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` and its threads."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    # fields[0] is the state (field 3); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm", encoding="ascii") as handle:
        return int(handle.read().split()[1]) * _PAGE_BYTES


class PeakRss:
    """Samples a process's RSS in a thread; ``peak`` is the largest seen since ``start``."""

    def __init__(self, pid: int, interval_s: float = 0.01) -> None:
        self._pid = pid
        self._interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakRss:
        self.peak = rss_bytes(self._pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, rss_bytes(self._pid))
            except OSError:
                return
            time.sleep(self._interval_s)
