"""One cell of the plan (a workload, width, dtype and concurrency), measured on every
endpoint side by side: the floor, the service through each client, no batching, and the
ceiling (the service's look-up in this process, ``ceiling.py``). ``report.ENDPOINTS``
says what each endpoint is.

Where a target compares two figures close together, the cells it compares are measured in
turns (see ``runner.run_interleaved``), so that a slow stretch of this shared machine
falls on both sides:
- tiny requests at concurrency 1, with two steps between the floor and the service that
  say where the service's latency over the floor goes: the floor called with the
  clients' deadline, and the service called by a bare gRPC client;
- tiny requests at concurrency 64 at the targets' width: the floor and the service's
  sync and asyncio cells;
- large float32 requests at concurrency 1 at the targets' width: the floor and the
  service's sync, asyncio and chunked cells.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokembed.bench import processes
from tokembed.bench.ceiling import Ceiling, ceiling_ids
from tokembed.bench.meters import ServerMeter, SettleBetweenCells, TurnsMeter
from tokembed.bench.plan import TARGETS_D_MODEL, Cell, MiB, Plan
from tokembed.bench.runner import (
    AsyncTurns,
    Run,
    Turn,
    run_async,
    run_interleaved,
    run_threads,
    threaded_turns,
)
from tokembed.bench.workloads import LARGE, TINY, Workload
from tokembed.client import AsyncEmbeddingClient, EmbeddingClient, codec, dtypes
from tokembed.server.backends.base import Backend

CLIENT_MESSAGE_BYTES = 1 << 30
# The deadline the tokembed clients send with every call (they always send one).
CLIENT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class _Turns:
    """Which of a cell's endpoints are measured in turns (the floor and the sync client
    always), and how."""

    time_factor: int  # this many times a cell's time (and requests) for each endpoint
    rounds: int  # in this many turns
    warmup: int  # unmeasured calls before each turn
    latency_steps: bool  # also the floor with the clients' deadline and a bare service call
    asyncio: bool  # also the asyncio client (and EmbedChunked, for answers of 4 MiB and up)


# Tiny requests at c=1, where the first target compares p50s close together, with the
# steps between floor and service, at every width: 3x a cell's time in 24 turns (fewer,
# longer turns read a ratio that wandered from run to run: docs/benchmarks/README.md).
# Tiny calls are cheap, so the turns add little to a full run.
LATENCY_STEPS = _Turns(time_factor=3, rounds=24, warmup=2, latency_steps=True, asyncio=False)
# Tiny requests at c=64 (the second target, req/s), at the targets' width: twice a
# cell's time in 4 turns (measured one after the other, the floor and the ratio wandered
# from run to run: docs/benchmarks/README.md). Each turn starts and ends
# its 64 callers, which costs the side with the longer latencies a little more: if
# anything, against the service.
CONTENTION_TURNS = _Turns(time_factor=2, rounds=4, warmup=2, latency_steps=False, asyncio=True)
# Large float32 requests at c=1 (the large unary and chunked targets, and float16's
# reference), at the targets' width: twice a cell's time in 6 turns, each turn after
# one unmeasured call, as a cell measured alone starts after its warm-up (the first call
# after another endpoint's turn pays for pages the server's heap trim gave back
# meanwhile, which a steady caller never sees).
LARGE_TURNS = _Turns(time_factor=2, rounds=6, warmup=1, latency_steps=False, asyncio=True)


@dataclass(frozen=True)
class Endpoints:
    """What one width's cells are measured on."""

    floor_call: Any  # the floor's bare unary callable
    service_bare_call: Any  # the service's Embed as a bare unary callable
    unary: EmbeddingClient  # the sync client, unary calls only
    chunked: EmbeddingClient  # the sync client, EmbedChunked for answers of 1 MiB and up
    ceiling: Backend  # the service's backend for the same model, in this process
    service_proc: processes.Child
    nobatch_proc: processes.Child
    floor_pid: int
    settle: SettleBetweenCells


def measure_cell(
    plan: Plan,
    workload: Workload,
    d_model: int,
    dtype: str,
    concurrency: int,
    requests: list[Any],
    at: Endpoints,
) -> Iterator[Cell]:
    measure = _CellMeasure(plan, workload, d_model, dtype, concurrency, requests)
    service_pid = at.service_proc.pid
    # The floor: the same request bytes out, a same-sized answer back, no decoding.
    floor_requests = [_encode_request(r, dtype) for r in requests]

    def sync_unary(ids: Any) -> object:
        return at.unary.embed(ids, dtype)

    def sync_chunked(ids: Any) -> object:
        return at.chunked.embed(ids, dtype)

    chunked_wanted = measure.answer_bytes >= 4 * MiB
    turns = _turns_for(workload, concurrency, dtype, d_model)
    if turns is None:
        with ServerMeter(at.floor_pid) as meter:
            run = measure.threads(at.floor_call, floor_requests)
        yield measure.cell("floor", run, meter)
        at.settle.before(service_pid, measure.inflight_bytes)
        with ServerMeter(service_pid) as meter:
            run = measure.threads(sync_unary, requests)
        yield measure.cell("service-sync", run, meter)
    else:
        at.settle.before(service_pid, measure.inflight_bytes)
        client = _AsyncClient(at.service_proc.target, dtype) if turns.asyncio else None
        with (
            AsyncTurns(setup=client.open, teardown=client.close) if client else AsyncTurns()
        ) as loop:

            def threads(call: Callable[[Any], object], reqs: list[Any]) -> Turn:
                return threaded_turns(call, reqs, concurrency=concurrency, warmup=turns.warmup)

            def with_client_deadline(call: Any) -> Callable[[object], object]:
                return lambda request: call(request, timeout=CLIENT_TIMEOUT_S)

            steps = {"floor": (threads(at.floor_call, floor_requests), at.floor_pid, "")}
            if turns.latency_steps:
                steps["floor-deadline"] = (
                    threads(with_client_deadline(at.floor_call), floor_requests), at.floor_pid,
                    "the floor, called with the clients' deadline",
                )  # fmt: skip
                steps["service-bare"] = (
                    threads(with_client_deadline(at.service_bare_call), floor_requests),
                    service_pid,
                    "bare gRPC call: the floor's request bytes, the clients' deadline, no decode",
                )  # fmt: skip
            steps["service-sync"] = (threads(sync_unary, requests), service_pid, "")
            if client is not None:
                steps["service-async"] = (
                    loop.turns(client.embed, requests, concurrency=concurrency,
                               warmup=turns.warmup),
                    service_pid, "",
                )  # fmt: skip
                if chunked_wanted:
                    steps["service-chunked"] = (
                        threads(sync_chunked, requests),
                        service_pid,
                        "EmbedChunked, 1 MiB slices",
                    )
            cells_in_turns = measure.in_turns(steps, turns)
        yield from cells_in_turns

    if turns is None or not turns.asyncio:
        client = _AsyncClient(at.service_proc.target, dtype)
        with ServerMeter(service_pid) as meter:
            run = measure.asyncio(client.embed, requests, client)
        yield measure.cell("service-async", run, meter)

        if chunked_wanted:
            with ServerMeter(service_pid) as meter:
                run = measure.threads(sync_chunked, requests)
            yield measure.cell("service-chunked", run, meter, "EmbedChunked, 1 MiB slices")

    if not chunked_wanted:

        def stream_one(ids: Any) -> object:
            # Read the stream to its end, so it closes (an abandoned stream stays open
            # on the server until garbage collection and slows every later cell).
            (answer,) = at.unary.embed_stream([ids], dtype)
            return answer

        with ServerMeter(service_pid) as meter:
            run = measure.threads(stream_one, requests)
        yield measure.cell("service-stream", run, meter, "one EmbedStream per request")

    no_batch = _AsyncClient(at.nobatch_proc.target, dtype)
    at.settle.before(at.nobatch_proc.pid, measure.inflight_bytes)
    with ServerMeter(at.nobatch_proc.pid) as meter:
        run = measure.asyncio(no_batch.embed, requests, no_batch)
    yield measure.cell("no-batching", run, meter, "--max-batch-tokens 1, async client")

    ceiling = Ceiling(at.ceiling, dtype)
    ceiling_requests = [ceiling_ids(r) for r in requests]
    yield measure.cell("ceiling", measure.threads(ceiling, ceiling_requests), None,
                       "the service's look-up in process, no transport")  # fmt: skip


class _CellMeasure:
    """One cell's budget and the bookkeeping shared by its endpoints' figures."""

    def __init__(
        self,
        plan: Plan,
        workload: Workload,
        d_model: int,
        dtype: str,
        concurrency: int,
        requests: list[Any],
    ) -> None:
        self.workload = workload
        self.d_model = d_model
        self.dtype = dtype
        self.concurrency = concurrency
        self.tokens = float(np.mean([_count_tokens(r) for r in requests]))
        itemsize = dtypes.OUTPUT[dtype].itemsize
        self.answer_bytes = float(workload.output_rows() * d_model * itemsize)
        self.inflight_bytes = concurrency * self.answer_bytes
        self.duration_s = plan.duration_s
        self.max_requests = _max_requests(plan, self.answer_bytes)

    def threads(self, call: Callable[[Any], object], requests: list[Any]) -> Run:
        return run_threads(
            call, requests, concurrency=self.concurrency, duration_s=self.duration_s,
            max_requests=self.max_requests,
        )  # fmt: skip

    def asyncio(self, call: Any, requests: list[Any], client: _AsyncClient) -> Run:
        return run_async(
            call, requests, concurrency=self.concurrency, duration_s=self.duration_s,
            max_requests=self.max_requests, setup=client.open, teardown=client.close,
        )  # fmt: skip

    def in_turns(self, steps: dict[str, tuple[Turn, int, str]], turns: _Turns) -> list[Cell]:
        """``steps``: name -> (its turn, the server pid it loads, notes)."""
        meters = {name: TurnsMeter(pid) for name, (_, pid, _) in steps.items()}
        runs = run_interleaved(
            {name: turn for name, (turn, _, _) in steps.items()},
            duration_s=turns.time_factor * self.duration_s,
            max_requests=turns.time_factor * self.max_requests,
            rounds=turns.rounds,
            during=lambda name: meters[name].turn(),
        )
        return [
            self.cell(name, runs[name], meters[name], f"{notes}; in turns" if notes else "in turns")
            for name, (_, _, notes) in steps.items()
        ]

    def cell(
        self, target: str, run: Run, meter: ServerMeter | TurnsMeter | None, notes: str = ""
    ) -> Cell:
        cpu_per_request = float("nan")
        if meter is not None and run.requests:
            # The meter ran around the warm-up calls too (one per turn for cells in turns).
            cpu_per_request = meter.cpu_s / (run.requests + run.warmups)
        return Cell(
            target=target, workload=self.workload.name, shape=self.workload.shape_text,
            d_model=self.d_model, dtype=self.dtype, concurrency=self.concurrency, run=run,
            tokens_per_request=self.tokens, bytes_per_request=self.answer_bytes,
            server_cpu_s_per_request=cpu_per_request,
            server_peak_rss_bytes=meter.peak_rss if meter else 0, notes=notes,
        )  # fmt: skip


class _AsyncClient:
    """An asyncio client opened and closed on the event loop that drives it."""

    def __init__(self, target: str, dtype: str) -> None:
        self._target = target
        self._dtype = dtype
        self._client: AsyncEmbeddingClient | None = None

    async def open(self) -> None:
        self._client = AsyncEmbeddingClient(
            self._target, chunked_threshold_bytes=None,
            max_message_bytes=CLIENT_MESSAGE_BYTES, timeout_s=CLIENT_TIMEOUT_S,
        )  # fmt: skip

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def embed(self, ids: Any) -> object:
        assert self._client is not None, "_AsyncClient.embed before open"
        return await self._client.embed(ids, self._dtype)


def _turns_for(workload: Workload, concurrency: int, dtype: str, d_model: int) -> _Turns | None:
    """Where a target compares two figures of float32 cells: measure them in turns."""
    if dtype != "float32":
        return None
    if workload is TINY and concurrency == 1:
        return LATENCY_STEPS
    if d_model != TARGETS_D_MODEL:
        return None
    if workload is TINY and concurrency == 64:
        return CONTENTION_TURNS
    if workload is LARGE and concurrency == 1:
        return LARGE_TURNS
    return None


def _max_requests(plan: Plan, answer_bytes: float) -> int:
    # Bound big answers by bytes too: ~1.5 GB per cell is plenty for a steady figure.
    return int(min(plan.max_requests, max(20, 1.5e9 // max(answer_bytes, 1))))


def _count_tokens(ids: Any) -> int:
    if isinstance(ids, np.ndarray):
        return int(ids.size)
    return sum(len(row) for row in ids)


def _encode_request(ids: Any, dtype: str) -> bytes:
    return codec.encode_request(codec.encode_ids(ids), dtype=dtype, layout="padded")
