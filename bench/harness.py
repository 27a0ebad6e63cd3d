"""The measurement plan: every cell side by side in one run, against its references.

Per model width D, the harness starts three processes and measures, per workload,
concurrency and output dtype:
- floor:       a bare gRPC endpoint returning a same-sized payload, bare gRPC client;
- service:     ``tokembed serve``, through the sync and asyncio clients (unary, chunked
               streaming for large answers, EmbedStream);
- no batching: a second ``tokembed serve`` with ``--max-batch-tokens 1``;
- ceiling:     the same look-up in-process with onnxruntime, no transport at all.
Tiny requests at concurrency 1, where the first target compares latencies, are measured
in turns (floor and service alternating, see ``run_interleaved``), with two steps in
between to say where the service's latency over the floor goes: the floor called with the
clients' deadline, and the service called by a bare gRPC client (the same request bytes
and deadline, no decode).
Server CPU seconds per request and peak RSS are read from /proc for the server processes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from tokembed.bench import floor as floor_module
from tokembed.bench import processes
from tokembed.bench.procstats import PeakRss, cpu_seconds
from tokembed.bench.runner import Run, run_async, run_interleaved, run_threads
from tokembed.bench.workloads import LARGE, MEDIUM, RAGGED, TINY, Workload
from tokembed.client import AsyncEmbeddingClient, EmbeddingClient, codec
from tokembed.client._config import METHOD_EMBED
from tokembed.server.settings import Settings

logger = logging.getLogger(__name__)

MiB = 1 << 20
VOCAB_SIZE = 32000
CLIENT_MESSAGE_BYTES = 1 << 30
# The deadline the tokembed clients send with every call (they always send one).
CLIENT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Plan:
    d_models: tuple[int, ...]
    workloads: tuple[Workload, ...]
    concurrencies: tuple[int, ...]
    dtypes: tuple[str, ...]
    duration_s: float
    max_requests: int
    # Concurrency cap for answers this many bytes or larger (64 x 33.5 MB in flight
    # measures memory, not transport).
    large_answer_bytes: int = 16 * MiB
    large_max_concurrency: int = 8


QUICK = Plan(
    d_models=(512,), workloads=(TINY, LARGE), concurrencies=(1, 64), dtypes=("float32", "float16"),
    duration_s=0.6, max_requests=3000,
)  # fmt: skip
FULL = Plan(
    d_models=(512, 4096), workloads=(TINY, MEDIUM, LARGE, RAGGED), concurrencies=(1, 8, 64),
    dtypes=("float32", "float16"), duration_s=2.0, max_requests=20000,
)  # fmt: skip


@dataclass
class Cell:
    target: str  # floor, service-sync, service-async, service-chunked, ...
    workload: str
    shape: str
    d_model: int
    dtype: str
    concurrency: int
    run: Run
    tokens_per_request: float
    bytes_per_request: float
    server_cpu_s_per_request: float = float("nan")
    server_peak_rss_bytes: int = 0
    notes: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.run.rps * self.tokens_per_request

    @property
    def mb_per_s(self) -> float:
        return self.run.rps * self.bytes_per_request / 1e6


@dataclass
class Results:
    plan: Plan
    cells: list[Cell] = field(default_factory=list)
    weights_bytes: dict[int, int] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)

    def find(
        self, target: str, workload: str, d_model: int, dtype: str, concurrency: int
    ) -> Cell | None:
        for cell in self.cells:
            if (cell.target, cell.workload, cell.d_model, cell.dtype, cell.concurrency) == (
                target, workload, d_model, dtype, concurrency,
            ):  # fmt: skip
                return cell
        return None


def ensure_model(cache_dir: Path, d_model: int) -> Path:
    """The bench model for width D (V=32000, seed 0), exported once and reused."""
    from tokembed.export.errors import ModelDirError
    from tokembed.export.model_dir import load_model_dir

    directory = cache_dir / f"bench-v{VOCAB_SIZE}-d{d_model}"
    try:
        load_model_dir(directory, verify_hashes=False)
        return directory
    except ModelDirError:
        pass
    from tokembed.export.module import TokenEmbedding, random_table
    from tokembed.export.onnx_export import ExportOptions, export_model

    table = random_table(VOCAB_SIZE, d_model, 0, None)
    module = TokenEmbedding(VOCAB_SIZE, d_model, weight=table)
    export_model(module, ExportOptions(out_dir=directory, name=f"bench-d{d_model}", force=True))
    return directory


def _server_args(plan: Plan, d_model: int) -> list[str]:
    largest = max(w.output_rows() for w in plan.workloads) * d_model * 4
    limit = max(128 * MiB, largest)
    return [
        "--max-output-bytes-per-request", str(limit),
        "--max-inflight-output-bytes", str(limit * (plan.large_max_concurrency + 2)),
        "--max-tokens-per-request", str(max(65536, max(w.output_rows() for w in plan.workloads))),
        "--max-queued-tokens", str(1 << 22),
    ]  # fmt: skip


class _ServerMeter:
    """CPU seconds and peak RSS of the server processes during one cell."""

    def __init__(self, pid: int | None) -> None:
        self._pid = pid
        self._cpu = 0.0
        self._rss: PeakRss | None = None
        self.cpu_s = float("nan")
        self.peak_rss = 0

    def __enter__(self) -> _ServerMeter:
        if self._pid is not None:
            self._cpu = cpu_seconds(self._pid)
            self._rss = PeakRss(self._pid).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pid is not None and self._rss is not None:
            self._rss.__exit__()
            self.cpu_s = cpu_seconds(self._pid) - self._cpu
            self.peak_rss = self._rss.peak


class _TurnsMeter:
    """CPU seconds and peak RSS of a server process summed over several turns (for the
    cells measured in turns, see run_interleaved)."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self.cpu_s = 0.0
        self.peak_rss = 0

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        with _ServerMeter(self._pid) as meter:
            yield
        self.cpu_s += meter.cpu_s
        self.peak_rss = max(self.peak_rss, meter.peak_rss)


class _SettleBetweenCells:
    """Before a cell lighter than the last one on the same server, wait out the server's
    heap trim, so that the cell's RSS peak is its own and not what the last one left."""

    def __init__(self, wait_s: float) -> None:
        self._wait_s = wait_s
        self._last_inflight: dict[int, float] = {}

    def before(self, pid: int, inflight_bytes: float) -> None:
        if self._last_inflight.get(pid, 0.0) > inflight_bytes:
            time.sleep(self._wait_s)
        self._last_inflight[pid] = inflight_bytes


def _requests(workload: Workload, count: int = 16) -> list[Any]:
    rng = np.random.default_rng(1234)
    return [workload.make_ids(rng, VOCAB_SIZE) for _ in range(count)]


def run_plan(
    plan: Plan, cache_dir: Path, *, device: str = "cpu", progress: Callable[[str], None] = print
) -> Results:
    results = Results(plan=plan)
    results.environment = {
        "cpus": str(os.cpu_count()),
        "device": device,
    }
    for d_model in plan.d_models:
        model_dir = ensure_model(cache_dir, d_model)
        # The served tables: the model's files, plus the row tables the server keeps with
        # its default settings.
        results.weights_bytes[d_model] = (
            sum(p.stat().st_size for p in model_dir.iterdir() if p.name.startswith("model.onnx"))
            + Settings().float16_table_bytes(VOCAB_SIZE, d_model)
            + Settings().float32_table_bytes(VOCAB_SIZE, d_model)
        )
        server_args = [*_server_args(plan, d_model), "--device", device]
        with (
            processes.floor(d_model) as floor_proc,
            processes.service(str(model_dir), *server_args) as service_proc,
            processes.service(str(model_dir), *server_args, "--max-batch-tokens", "1") as nobatch,
        ):
            for cell in _measure_width(
                plan, d_model, model_dir, floor_proc, service_proc, nobatch, device
            ):
                results.cells.append(cell)
                progress(_progress_line(cell))
    return results


def _progress_line(cell: Cell) -> str:
    errors = f" errors={cell.run.errors} ({cell.run.first_error[:80]})" if cell.run.errors else ""
    return (
        f"{cell.target:16s} {cell.workload:7s} D={cell.d_model:<5d} {cell.dtype:8s} "
        f"c={cell.concurrency:<3d} {cell.run.rps:9.1f} req/s {cell.mb_per_s:9.1f} MB/s "
        f"p50={cell.run.percentile_ms(50):8.3f} ms p99={cell.run.percentile_ms(99):8.3f} ms{errors}"
    )


def _measure_width(
    plan: Plan,
    d_model: int,
    model_dir: Path,
    floor_proc: processes.Child,
    service_proc: processes.Child,
    nobatch_proc: processes.Child,
    device: str,
) -> Iterator[Cell]:
    import onnxruntime as ort

    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else None
    session = ort.InferenceSession(str(model_dir / "model.onnx"), providers=providers)
    floor_channel = grpc.insecure_channel(
        floor_proc.target,
        options=[("grpc.max_receive_message_length", CLIENT_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", CLIENT_MESSAGE_BYTES)],
    )  # fmt: skip
    floor_call = floor_channel.unary_unary(floor_module.METHOD)
    service_channel = grpc.insecure_channel(service_proc.target)
    service_bare_call = service_channel.unary_unary(METHOD_EMBED)
    unary = EmbeddingClient(service_proc.target, chunked_threshold_bytes=None,
                            max_message_bytes=CLIENT_MESSAGE_BYTES,
                            timeout_s=CLIENT_TIMEOUT_S)  # fmt: skip
    chunked = EmbeddingClient(service_proc.target, chunked_threshold_bytes=MiB,
                              max_message_bytes=CLIENT_MESSAGE_BYTES,
                              timeout_s=CLIENT_TIMEOUT_S)  # fmt: skip
    # The server trims its heap every memory_trim_interval_s; half as long again is enough.
    settle = _SettleBetweenCells(1.5 * Settings().memory_trim_interval_s)
    try:
        for workload in plan.workloads:
            answer_bytes = workload.output_rows() * d_model * 4
            if answer_bytes > 128 * MiB and d_model > 512 and workload is not LARGE:
                continue
            requests = _requests(workload)
            for concurrency in plan.concurrencies:
                if (
                    answer_bytes >= plan.large_answer_bytes
                    and concurrency > plan.large_max_concurrency
                ):
                    continue
                for dtype in plan.dtypes:
                    if dtype != "float32" and workload not in (LARGE, MEDIUM):
                        continue  # float16 halves bytes: it matters where bytes dominate
                    yield from _measure_cell(
                        plan, workload, d_model, dtype, concurrency, requests,
                        floor_call=floor_call, service_bare_call=service_bare_call,
                        unary=unary, chunked=chunked,
                        session=session, service_proc=service_proc, nobatch_proc=nobatch_proc,
                        floor_pid=floor_proc.pid, settle=settle,
                    )  # fmt: skip
    finally:
        unary.close()
        chunked.close()
        floor_channel.close()
        service_channel.close()


def _measure_cell(
    plan: Plan,
    workload: Workload,
    d_model: int,
    dtype: str,
    concurrency: int,
    requests: list[Any],
    *,
    floor_call: Any,
    service_bare_call: Any,
    unary: EmbeddingClient,
    chunked: EmbeddingClient,
    session: Any,
    service_proc: processes.Child,
    nobatch_proc: processes.Child,
    floor_pid: int,
    settle: _SettleBetweenCells,
) -> Iterator[Cell]:
    itemsize = 2 if dtype == "float16" else 4
    tokens = float(np.mean([_count_tokens(r) for r in requests]))
    answer_bytes = float(workload.output_rows() * d_model * itemsize)
    budget: dict[str, Any] = {
        "concurrency": concurrency,
        "duration_s": plan.duration_s,
        "max_requests": _max_requests(plan, answer_bytes),
    }

    def cell(
        target: str, run: Run, meter: _ServerMeter | _TurnsMeter | None, notes: str = ""
    ) -> Cell:
        cpu_per_request = float("nan")
        if meter is not None and run.requests:
            cpu_per_request = meter.cpu_s / run.requests
        return Cell(
            target=target, workload=workload.name, shape=workload.shape_text, d_model=d_model,
            dtype=dtype, concurrency=concurrency, run=run, tokens_per_request=tokens,
            bytes_per_request=answer_bytes, server_cpu_s_per_request=cpu_per_request,
            server_peak_rss_bytes=meter.peak_rss if meter else 0, notes=notes,
        )  # fmt: skip

    # The floor: the same request bytes out, a same-sized answer back, no decoding.
    floor_requests = [_encode_request(r, dtype) for r in requests]

    def sync_unary(ids: Any) -> object:
        return unary.embed(ids, dtype)

    if _latency_steps_wanted(workload, concurrency, dtype):
        # Where the first target compares latencies: the floor, the service, and two
        # steps between them, taken in turns (see run_interleaved).
        settle.before(service_proc.pid, concurrency * answer_bytes)

        def with_client_deadline(call: Any) -> Callable[[object], object]:
            return lambda request: call(request, timeout=CLIENT_TIMEOUT_S)

        steps: dict[str, tuple[Callable[[object], object], list[Any], int, str]] = {
            "floor": (floor_call, floor_requests, floor_pid, ""),
            "floor-deadline": (with_client_deadline(floor_call), floor_requests, floor_pid,
                               "the floor, called with the clients' deadline"),
            "service-bare": (with_client_deadline(service_bare_call), floor_requests,
                             service_proc.pid, "bare gRPC call: the floor's request bytes, "
                             "the clients' deadline, no decode"),
            "service-sync": (sync_unary, requests, service_proc.pid, ""),
        }  # fmt: skip
        meters = {name: _TurnsMeter(pid) for name, (_, _, pid, _) in steps.items()}
        runs = run_interleaved(
            {name: (call, reqs) for name, (call, reqs, _, _) in steps.items()},
            duration_s=LATENCY_STEPS_TIME_FACTOR * plan.duration_s,
            max_requests=LATENCY_STEPS_TIME_FACTOR * budget["max_requests"],
            rounds=LATENCY_STEPS_ROUNDS,
            during=lambda name: meters[name].turn(),
        )
        for name, (_, _, _, notes) in steps.items():
            yield cell(
                name, runs[name], meters[name], f"{notes}; in turns" if notes else "in turns"
            )
    else:
        with _ServerMeter(floor_pid) as meter:
            run = run_threads(floor_call, floor_requests, **budget)
        yield cell("floor", run, meter)
        settle.before(service_proc.pid, concurrency * answer_bytes)
        with _ServerMeter(service_proc.pid) as meter:
            run = run_threads(sync_unary, requests, **budget)
        yield cell("service-sync", run, meter)

    async_client: list[AsyncEmbeddingClient] = []

    async def open_async() -> None:
        async_client.append(AsyncEmbeddingClient(
            service_proc.target, chunked_threshold_bytes=None,
            max_message_bytes=CLIENT_MESSAGE_BYTES, timeout_s=CLIENT_TIMEOUT_S,
        ))  # fmt: skip

    async def close_async() -> None:
        await async_client[0].close()

    async def async_unary(ids: Any) -> object:
        return await async_client[0].embed(ids, dtype)

    with _ServerMeter(service_proc.pid) as meter:
        run = run_async(async_unary, requests, setup=open_async, teardown=close_async, **budget)
    yield cell("service-async", run, meter)

    if answer_bytes >= 4 * MiB:

        def sync_chunked(ids: Any) -> object:
            return chunked.embed(ids, dtype)

        with _ServerMeter(service_proc.pid) as meter:
            run = run_threads(sync_chunked, requests, **budget)
        yield cell("service-chunked", run, meter, "EmbedChunked, 1 MiB slices")
    else:

        def stream_one(ids: Any) -> object:
            # Read the stream to its end, so it closes (an abandoned stream stays open
            # on the server until garbage collection and slows every later cell).
            (answer,) = unary.embed_stream([ids], dtype)
            return answer

        with _ServerMeter(service_proc.pid) as meter:
            run = run_threads(stream_one, requests, **budget)
        yield cell("service-stream", run, meter, "one EmbedStream per request")

    no_batch: list[AsyncEmbeddingClient] = []

    async def open_nobatch() -> None:
        no_batch.append(AsyncEmbeddingClient(
            nobatch_proc.target, chunked_threshold_bytes=None,
            max_message_bytes=CLIENT_MESSAGE_BYTES, timeout_s=CLIENT_TIMEOUT_S,
        ))  # fmt: skip

    async def close_nobatch() -> None:
        await no_batch[0].close()

    async def nobatch_unary(ids: Any) -> object:
        return await no_batch[0].embed(ids, dtype)

    settle.before(nobatch_proc.pid, concurrency * answer_bytes)
    with _ServerMeter(nobatch_proc.pid) as meter:
        run = run_async(
            nobatch_unary, requests, setup=open_nobatch, teardown=close_nobatch, **budget
        )
    yield cell("no-batching", run, meter, "--max-batch-tokens 1, async client")

    flat_requests = [_flat_ids(r) for r in requests]

    def in_process(ids: np.ndarray) -> object:
        out = session.run(None, {"input_ids": ids})[0]
        return out.astype(np.float16) if dtype == "float16" else out

    run = run_threads(in_process, flat_requests, **budget)  # type: ignore[arg-type]
    yield cell("ceiling", run, None, "in-process onnxruntime")


# The four cells of the tiny c=1 steps get this many times a cell's time (and requests),
# in this many turns each. Why: the first target compares their p50s, ~0.1 ms apart on
# ~0.65 ms, and with a cell's time in 8 turns (~1,700 calls each) the service's step over
# the floor read 1.09-1.30 from run to run, where 30 turns of 250 calls in a script read
# 1.11-1.14 five times. Tiny calls are cheap: this adds ~10 s per width to a full run.
LATENCY_STEPS_TIME_FACTOR = 3
LATENCY_STEPS_ROUNDS = 24


def _latency_steps_wanted(workload: Workload, concurrency: int, dtype: str) -> bool:
    """Where the tiny c=1 target is judged: measure the steps between floor and service."""
    return workload is TINY and concurrency == 1 and dtype == "float32"


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


def speedup(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator and not math.isnan(denominator) else float("nan")
