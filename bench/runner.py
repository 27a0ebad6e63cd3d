"""Drive one callable at a fixed concurrency for a bounded time and count."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Run:
    requests: int
    errors: int
    wall_s: float
    latencies_s: np.ndarray
    first_error: str = ""

    @property
    def rps(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0

    def percentile_ms(self, q: float) -> float:
        if self.latencies_s.size == 0:
            return float("nan")
        return float(np.percentile(self.latencies_s, q) * 1000)


def run_threads(
    call: Callable[[object], object],
    requests: Sequence[object],
    *,
    concurrency: int,
    duration_s: float,
    max_requests: int,
    warmup: int = 2,
) -> Run:
    """``concurrency`` threads call ``call(request)`` in a loop until time or count runs out."""
    for request in list(requests)[:warmup]:
        call(request)
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    count = [0]
    deadline = time.perf_counter() + duration_s

    def worker(offset: int) -> None:
        index = offset
        while time.perf_counter() < deadline:
            with lock:
                if count[0] >= max_requests:
                    return
                count[0] += 1
            request = requests[index % len(requests)]
            index += 1
            started = time.perf_counter()
            try:
                call(request)
            except Exception as exc:  # counted, reported, never hidden
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                continue
            elapsed = time.perf_counter() - started
            with lock:
                latencies.append(elapsed)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return Run(
        len(latencies), len(errors), wall, np.asarray(latencies), errors[0] if errors else ""
    )


def run_async(
    call: Callable[[object], Awaitable[object]],
    requests: Sequence[object],
    *,
    concurrency: int,
    duration_s: float,
    max_requests: int,
    warmup: int = 2,
    setup: Callable[[], Awaitable[None]] | None = None,
    teardown: Callable[[], Awaitable[None]] | None = None,
) -> Run:
    """The same with ``concurrency`` asyncio tasks on one event loop."""

    async def main() -> Run:
        if setup is not None:
            await setup()
        try:
            for request in list(requests)[:warmup]:
                await call(request)
            latencies: list[float] = []
            errors: list[str] = []
            count = [0]
            deadline = time.perf_counter() + duration_s

            async def worker(offset: int) -> None:
                index = offset
                while time.perf_counter() < deadline and count[0] < max_requests:
                    count[0] += 1
                    request = requests[index % len(requests)]
                    index += 1
                    began = time.perf_counter()
                    try:
                        await call(request)
                    except Exception as exc:
                        errors.append(f"{type(exc).__name__}: {exc}")
                        continue
                    latencies.append(time.perf_counter() - began)

            began = time.perf_counter()
            await asyncio.gather(*(worker(i) for i in range(concurrency)))
            wall = time.perf_counter() - began
            return Run(
                len(latencies), len(errors), wall, np.asarray(latencies),
                errors[0] if errors else "",
            )  # fmt: skip
        finally:
            if teardown is not None:
                await teardown()

    return asyncio.run(main())
