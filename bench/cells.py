"""One cell of the plan (a workload, width, dtype and concurrency), measured on every
endpoint side by side: the floor, the service through each client, no batching, and the
in-process ceiling.

Where a target compares two figures ~10% apart, the cells it compares are measured in
turns (see ``runner.run_interleaved``), so that a slow stretch of this shared machine
falls on both sides:
- tiny requests at concurrency 1, with two steps between the floor and the service that
  say where the service's latency over the floor goes: the floor called with the
  clients' deadline, and the service called by a bare gRPC client;
- large float32 requests at concurrency 1 at the targets' width: the floor and the
  service's sync, asyncio and chunked cells.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokembed.bench import processes
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
from tokembed.client import AsyncEmbeddingClient, EmbeddingClient, codec

CLIENT_MESSAGE_BYTES = 1 << 30
# The deadline the tokembed clients send with every call (they always send one).
CLIENT_TIMEOUT_S = 120.0

# The four cells of the tiny c=1 steps get this many times a cell's time (and requests),
# in this many turns each. Why: the first target compares their p50s, ~0.1 ms apart on
# ~0.65 ms, and with a cell's time in 8 turns (~1,700 calls each) the service's step over
# the floor read 1.09-1.30 from run to run, where 30 turns of 250 calls in a script read
# 1.11-1.14 five times. Tiny calls are cheap: this adds ~10 s per width to a full run.
LATENCY_STEPS_TIME_FACTOR = 3
LATENCY_STEPS_ROUNDS = 24

# The large c=1 float32 cells in turns: twice a cell's time, in 6 turns of ~5 calls of
# 40-90 ms (at D=512), each turn after one unmeasured call, as a cell measured alone
# starts after its warm-up (the first call after another endpoint's turn pays for pages
# the server's heap trim gave back meanwhile, which a steady caller never sees). Why:
# measured one after the other, ~15 calls each, large unary read 0.86-1.06 of the floor
# over nine runs and chunked once 1.11 (1.58-1.89 otherwise), the floor's and the
# service's seconds falling on different stretches of the machine. Adds ~6 s per run.
LARGE_TURNS_TIME_FACTOR = 2
LARGE_TURNS_ROUNDS = 6
LARGE_TURNS_WARMUP = 1


@dataclass(frozen=True)
class Endpoints:
    """What one width's cells are measured on."""

    floor_call: Any  # the floor's bare unary callable
    service_bare_call: Any  # the service's Embed as a bare unary callable
    unary: EmbeddingClient  # the sync client, unary calls only
    chunked: EmbeddingClient  # the sync client, EmbedChunked for answers of 1 MiB and up
    session: Any  # onnxruntime's session on the same model: the ceiling
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
    large_in_turns = _large_turns_wanted(workload, concurrency, dtype, d_model)
    if _latency_steps_wanted(workload, concurrency, dtype):
        at.settle.before(service_pid, measure.inflight_bytes)

        def with_client_deadline(call: Any) -> Callable[[object], object]:
            return lambda request: call(request, timeout=CLIENT_TIMEOUT_S)

        yield from measure.in_turns(
            {
                "floor": (threaded_turns(at.floor_call, floor_requests), at.floor_pid, ""),
                "floor-deadline": (
                    threaded_turns(with_client_deadline(at.floor_call), floor_requests),
                    at.floor_pid, "the floor, called with the clients' deadline",
                ),
                "service-bare": (
                    threaded_turns(with_client_deadline(at.service_bare_call), floor_requests),
                    service_pid, "bare gRPC call: the floor's request bytes, the clients' "
                    "deadline, no decode",
                ),
                "service-sync": (threaded_turns(sync_unary, requests), service_pid, ""),
            },
            time_factor=LATENCY_STEPS_TIME_FACTOR, rounds=LATENCY_STEPS_ROUNDS,
        )  # fmt: skip
    elif large_in_turns:
        at.settle.before(service_pid, measure.inflight_bytes)
        client = _AsyncClient(at.service_proc.target, dtype)
        warm = LARGE_TURNS_WARMUP
        with AsyncTurns(setup=client.open, teardown=client.close) as loop:
            large_cells = measure.in_turns(
                {
                    "floor": (threaded_turns(at.floor_call, floor_requests, warmup=warm),
                              at.floor_pid, ""),
                    "service-sync": (threaded_turns(sync_unary, requests, warmup=warm),
                                     service_pid, ""),
                    "service-async": (loop.turns(client.embed, requests, warmup=warm),
                                      service_pid, ""),
                    "service-chunked": (threaded_turns(sync_chunked, requests, warmup=warm),
                                        service_pid, "EmbedChunked, 1 MiB slices"),
                },
                time_factor=LARGE_TURNS_TIME_FACTOR, rounds=LARGE_TURNS_ROUNDS,
            )  # fmt: skip
        yield from large_cells
    else:
        with ServerMeter(at.floor_pid) as meter:
            run = measure.threads(at.floor_call, floor_requests)
        yield measure.cell("floor", run, meter)
        at.settle.before(service_pid, measure.inflight_bytes)
        with ServerMeter(service_pid) as meter:
            run = measure.threads(sync_unary, requests)
        yield measure.cell("service-sync", run, meter)

    if not large_in_turns:
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

    flat_requests = [_flat_ids(r) for r in requests]

    def in_process(ids: Any) -> object:
        out = at.session.run(None, {"input_ids": ids})[0]
        return out.astype(np.float16) if dtype == "float16" else out

    yield measure.cell("ceiling", measure.threads(in_process, flat_requests), None,
                       "in-process onnxruntime")  # fmt: skip


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
        itemsize = 2 if dtype == "float16" else 4
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

    def in_turns(
        self, steps: dict[str, tuple[Turn, int, str]], *, time_factor: int, rounds: int
    ) -> list[Cell]:
        """``steps``: name -> (its turn, the server pid it loads, notes)."""
        meters = {name: TurnsMeter(pid) for name, (_, pid, _) in steps.items()}
        runs = run_interleaved(
            {name: turn for name, (turn, _, _) in steps.items()},
            duration_s=time_factor * self.duration_s,
            max_requests=time_factor * self.max_requests,
            rounds=rounds,
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
            cpu_per_request = meter.cpu_s / run.requests
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


def _latency_steps_wanted(workload: Workload, concurrency: int, dtype: str) -> bool:
    """Where the tiny c=1 target is judged: measure the steps between floor and service."""
    return workload is TINY and concurrency == 1 and dtype == "float32"


def _large_turns_wanted(workload: Workload, concurrency: int, dtype: str, d_model: int) -> bool:
    """Where the large unary and chunked targets are judged (and float16's reference)."""
    return (
        workload is LARGE
        and concurrency == 1
        and dtype == "float32"
        and (d_model == TARGETS_D_MODEL)
    )


def _max_requests(plan: Plan, answer_bytes: float) -> int:
    # Bound big answers by bytes too: ~1.5 GB per cell is plenty for a steady figure.
    return int(min(plan.max_requests, max(20, 1.5e9 // max(answer_bytes, 1))))


def _count_tokens(ids: Any) -> int:
    if isinstance(ids, np.ndarray):
        return int(ids.size)
    return sum(len(row) for row in ids)


def _flat_ids(ids: Any) -> np.ndarray:
    if isinstance(ids, np.ndarray):
        return ids
    flat = np.concatenate([np.asarray(row, dtype=np.int64) for row in ids])
    return flat.reshape(1, -1)


def _encode_request(ids: Any, dtype: str) -> bytes:
    return codec.encode_request(codec.encode_ids(ids), dtype=dtype, layout="padded")
