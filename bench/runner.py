"""Drive one callable at a fixed concurrency for a bounded time and count."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Run:
    requests: int
    errors: int
    wall_s: float
    latencies_s: np.ndarray
    first_error: str = ""
    # Unmeasured calls made before the measured ones (their server CPU is in a meter
    # around the run, their time is not in ``wall_s``).
    warmups: int = 0

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
    warmups = list(requests)[:warmup]
    for request in warmups:
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
    return _run_of(latencies, errors, wall, len(warmups))


# One turn of a call measured in turns: given its seconds and its request count, a Run.
Turn = Callable[[float, int], Run]


def threaded_turns(
    call: Callable[[object], object],
    requests: Sequence[object],
    *,
    concurrency: int = 1,
    warmup: int = 2,
) -> Turn:
    """``call`` from ``concurrency`` threads, ``warmup`` unmeasured calls per turn."""

    def turn(duration_s: float, max_requests: int) -> Run:
        return run_threads(
            call, requests, concurrency=concurrency, duration_s=duration_s,
            max_requests=max_requests, warmup=warmup,
        )  # fmt: skip

    return turn


class AsyncTurns:
    """One event loop kept across turns, for asyncio calls measured in turns.

    An asyncio client is bound to the loop it was opened on, so ``setup`` opens it once
    here and every turn runs on the same loop: no reconnect per turn, as a caller in a
    steady loop would not reconnect either.
    """

    def __init__(
        self,
        setup: Callable[[], Coroutine[Any, Any, None]] | None = None,
        teardown: Callable[[], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        self._setup = setup
        self._teardown = teardown
        self._loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> AsyncTurns:
        loop = asyncio.new_event_loop()  # not asyncio.Runner: Python 3.10 is supported
        try:
            if self._setup is not None:
                loop.run_until_complete(self._setup())
        except BaseException:
            loop.close()
            raise
        self._loop = loop
        return self

    def __exit__(self, *exc: object) -> None:
        loop = self._loop
        assert loop is not None
        self._loop = None
        try:
            if self._teardown is not None:
                loop.run_until_complete(self._teardown())
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def turns(
        self,
        call: Callable[[object], Awaitable[object]],
        requests: Sequence[object],
        *,
        concurrency: int = 1,
        warmup: int = 2,
    ) -> Turn:
        """``call`` from ``concurrency`` tasks on this loop, ``warmup`` unmeasured calls
        per turn."""

        def turn(duration_s: float, max_requests: int) -> Run:
            assert self._loop is not None, "AsyncTurns.turns used outside its with block"
            return self._loop.run_until_complete(
                _drive_async(call, requests, concurrency=concurrency, duration_s=duration_s,
                             max_requests=max_requests, warmup=warmup)
            )  # fmt: skip

        return turn


def run_interleaved(
    turns: Mapping[str, Turn],
    *,
    duration_s: float,
    max_requests: int,
    rounds: int = 8,
    seed: int = 0,
    during: Callable[[str], AbstractContextManager[object]] | None = None,
) -> dict[str, Run]:
    """Each named call (see ``threaded_turns``, ``AsyncTurns``, which also say at what
    concurrency) in ``rounds`` turns of equal length in a shuffled order each round; each
    gets ``duration_s`` and ``max_requests`` in all.

    For figures compared with each other: run one after the other, each in its own
    seconds, a shared machine's slow moment falls on one of them only (the tiny c=1
    ratio wandered from run to run that way: docs/benchmarks/README.md); taken in turns
    it falls on all.
    ``during(name)``, if given, is entered around each of that call's turns (a meter).
    """
    taken: dict[str, list[Run]] = {name: [] for name in turns}
    order = list(turns)
    shuffler = random.Random(seed)
    for _ in range(rounds):
        shuffler.shuffle(order)
        for name in order:
            with during(name) if during is not None else contextlib.nullcontext():
                taken[name].append(turns[name](duration_s / rounds, max(1, max_requests // rounds)))
    return {name: _merged(runs) for name, runs in taken.items()}


def _run_of(latencies: list[float], errors: list[str], wall_s: float, warmups: int) -> Run:
    return Run(
        len(latencies), len(errors), wall_s, np.asarray(latencies), errors[0] if errors else "",
        warmups=warmups,
    )  # fmt: skip


def _merged(runs: list[Run]) -> Run:
    errors = [run.first_error for run in runs if run.first_error]
    return Run(
        requests=sum(run.requests for run in runs),
        errors=sum(run.errors for run in runs),
        wall_s=sum(run.wall_s for run in runs),
        latencies_s=np.concatenate([run.latencies_s for run in runs]),
        first_error=errors[0] if errors else "",
        warmups=sum(run.warmups for run in runs),
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
    """The same as ``run_threads`` with ``concurrency`` asyncio tasks on one event loop."""

    async def main() -> Run:
        if setup is not None:
            await setup()
        try:
            return await _drive_async(
                call, requests, concurrency=concurrency, duration_s=duration_s,
                max_requests=max_requests, warmup=warmup,
            )  # fmt: skip
        finally:
            if teardown is not None:
                await teardown()

    return asyncio.run(main())


async def _drive_async(
    call: Callable[[object], Awaitable[object]],
    requests: Sequence[object],
    *,
    concurrency: int,
    duration_s: float,
    max_requests: int,
    warmup: int,
) -> Run:
    warmups = list(requests)[:warmup]
    for request in warmups:
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
            except Exception as exc:  # counted, reported, never hidden
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            latencies.append(time.perf_counter() - began)

    began = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    wall = time.perf_counter() - began
    return _run_of(latencies, errors, wall, len(warmups))
