"""CPU seconds and resident memory of another process (psutil)."""

from __future__ import annotations

import threading
import time

import psutil


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` and its threads."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


class PeakRss:
    """Samples a process's RSS in a thread; ``peak`` is the largest seen since ``start``.

    Sampled, since no library gives the peak over a window: the kernel's high-water mark
    (``VmHWM``) counts from the process's start, not from the cell's.
    """

    def __init__(self, pid: int, interval_s: float = 0.01) -> None:
        self._process = psutil.Process(pid)
        self._interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakRss:
        self.peak = self._rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _rss(self) -> int:
        return int(self._process.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self._rss())
            except psutil.Error:  # the process ended
                return
            time.sleep(self._interval_s)
