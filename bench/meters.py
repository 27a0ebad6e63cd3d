"""What the server processes spend during a cell: CPU seconds and peak RSS."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from tokembed.bench.procstats import PeakRss, cpu_seconds


class ServerMeter:
    """CPU seconds and peak RSS of the server processes during one cell."""

    def __init__(self, pid: int | None) -> None:
        self._pid = pid
        self._cpu = 0.0
        self._rss: PeakRss | None = None
        self.cpu_s = float("nan")
        self.peak_rss = 0

    def __enter__(self) -> ServerMeter:
        if self._pid is not None:
            self._cpu = cpu_seconds(self._pid)
            self._rss = PeakRss(self._pid).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pid is not None and self._rss is not None:
            self._rss.__exit__()
            self.cpu_s = cpu_seconds(self._pid) - self._cpu
            self.peak_rss = self._rss.peak


class TurnsMeter:
    """CPU seconds and peak RSS of a server process summed over several turns (for the
    cells measured in turns, see run_interleaved)."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self.cpu_s = 0.0
        self.peak_rss = 0

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        with ServerMeter(self._pid) as meter:
            yield
        self.cpu_s += meter.cpu_s
        self.peak_rss = max(self.peak_rss, meter.peak_rss)


class SettleBetweenCells:
    """Before a cell lighter than the last one on the same server, wait out the server's
    heap trim, so that the cell's RSS peak is its own and not what the last one left."""

    def __init__(self, wait_s: float) -> None:
        self._wait_s = wait_s
        self._last_inflight: dict[int, float] = {}

    def before(self, pid: int, inflight_bytes: float) -> None:
        if self._last_inflight.get(pid, 0.0) > inflight_bytes:
            time.sleep(self._wait_s)
        self._last_inflight[pid] = inflight_bytes
