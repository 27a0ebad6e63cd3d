"""The measurement plan run: every cell side by side in one run, against its references.

Per model width D, the harness starts three processes and measures, per workload,
concurrency and output dtype (see ``cells.measure_cell``; ``report.ENDPOINTS`` says what
each endpoint is):
- floor:       a bare gRPC endpoint returning a same-sized payload, bare gRPC client;
- service:     ``tokembed serve``, through the sync and asyncio clients (unary, chunked
               streaming for large answers, EmbedStream);
- no batching: a second ``tokembed serve`` with ``--max-batch-tokens 1``;
- ceiling:     the service's own look-up in this process (``ceiling.py``), no transport.
Then, where the plan has them, the model kinds' cells (``kinds.py``).
Server CPU seconds per request and peak RSS are read (psutil) for the server processes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from tokembed.bench import floor as floor_module
from tokembed.bench import processes
from tokembed.bench.ceiling import load_backend
from tokembed.bench.cells import CLIENT_MESSAGE_BYTES, CLIENT_TIMEOUT_S, Endpoints, measure_cell
from tokembed.bench.meters import SettleBetweenCells
from tokembed.bench.plan import TARGETS_D_MODEL, Cell, MiB, Plan, Results
from tokembed.bench.workloads import LARGE, MEDIUM, Workload
from tokembed.client import EmbeddingClient
from tokembed.client._config import METHOD_EMBED
from tokembed.server.process.settings import Settings

VOCAB_SIZE = 32000


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
    from tokembed.export.modules import TokenEmbedding, random_table
    from tokembed.export.pipeline import ExportOptions, export_model

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


def _requests(workload: Workload, count: int = 16) -> list[Any]:
    rng = np.random.default_rng(1234)
    return [workload.make_ids(rng, VOCAB_SIZE) for _ in range(count)]


def run_plan(
    plan: Plan,
    cache_dir: Path,
    *,
    device: str = "cpu",
    server_env: Mapping[str, str] | None = None,
    progress: Callable[[str], None] = print,
    main: bool = True,
    v2: bool = False,
    mlserver_venv: Path | None = None,
) -> Results:
    """``server_env``: variables the service runs with (and not the floor or clients).
    ``main``: the main section (every width of the plan); ``v2``: the V2 section
    (``bench/v2.py``, D=512), with MLServer from ``mlserver_venv`` (None: without it)."""
    results = Results(plan=plan)
    progress(PROGRESS_HEADER)
    results.environment = {
        "cpus": str(os.cpu_count()),
        "device": device,
        "load average at the start": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        **{f"server {key}": value for key, value in (server_env or {}).items()},
    }
    if main:
        _run_main(plan, cache_dir, device, server_env, progress, results)
    if v2:
        from tokembed.bench.v2 import D_MODEL, run_v2

        model_dir = ensure_model(cache_dir, D_MODEL)
        results.v2_cells, results.v2_notes = run_v2(
            plan, model_dir, server_args=[*_server_args(plan, D_MODEL), "--device", device],
            server_env=server_env, mlserver_venv=mlserver_venv, progress=progress,
        )  # fmt: skip
    results.environment["load average at the end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return results


def _run_main(
    plan: Plan,
    cache_dir: Path,
    device: str,
    server_env: Mapping[str, str] | None,
    progress: Callable[[str], None],
    results: Results,
) -> None:
    for d_model in plan.d_models:
        model_dir = ensure_model(cache_dir, d_model)
        results.weights_bytes[d_model] = _served_weights_bytes(model_dir, d_model)
        server_args = [*_server_args(plan, d_model), "--device", device]
        with (
            processes.floor(d_model) as floor_proc,
            processes.service(str(model_dir), *server_args, env=server_env) as service_proc,
            processes.service(
                str(model_dir), *server_args, "--max-batch-tokens", "1", env=server_env
            ) as nobatch,
        ):
            for cell in _measure_width(
                plan, d_model, model_dir, floor_proc, service_proc, nobatch, device
            ):
                results.cells.append(cell)
                progress(_progress_line(cell))
    if plan.kinds:
        from tokembed.bench import kinds

        token_dir = ensure_model(cache_dir, TARGETS_D_MODEL)
        server_args = [*_server_args(plan, TARGETS_D_MODEL), "--device", device]
        for cell in kinds.measure_kinds(
            plan, token_dir, kinds.ensure_factorized_model(cache_dir), server_args, server_env
        ):
            results.cells.append(cell)
            progress(_progress_line(cell))


def _served_weights_bytes(model_dir: Path, d_model: int) -> int:
    """What the server keeps of the model with its default settings: its row tables (the
    table backend: float32, and float16 and bfloat16 where they fit; the model itself is
    let go after load), or the model's weights in onnxruntime (the onnxruntime backend, no
    tables)."""
    tables = Settings().tables(VOCAB_SIZE, d_model, "float32")
    if tables:
        return sum(tables.values())
    return sum(p.stat().st_size for p in model_dir.iterdir() if p.name.startswith("model.onnx"))


# The columns of the line printed for each cell as it is measured (``_progress_line``).
PROGRESS_HEADER = (
    f"{'endpoint':16s} {'workload':8s} {'D':>5s} {'dtype':8s} {'conc':>4s} "
    f"{'req/s':>9s} {'MB/s':>9s} {'p50 ms':>9s} {'p99 ms':>9s}"
)


def _progress_line(cell: Cell) -> str:
    errors = f" errors={cell.run.errors} ({cell.run.first_error[:80]})" if cell.run.errors else ""
    return (
        f"{cell.target:16s} {cell.workload:8s} {cell.d_model:5d} {cell.dtype:8s} "
        f"{cell.concurrency:4d} {cell.run.rps:9.1f} {cell.mb_per_s:9.1f} "
        f"{cell.run.percentile_ms(50):9.3f} {cell.run.percentile_ms(99):9.3f}{errors}"
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
    settle = SettleBetweenCells(1.5 * Settings().memory_trim_interval_s)
    endpoints = Endpoints(
        floor_call=floor_call, service_bare_call=service_bare_call, unary=unary,
        chunked=chunked, ceiling=load_backend(model_dir, device), service_proc=service_proc,
        nobatch_proc=nobatch_proc, floor_pid=floor_proc.pid, settle=settle,
    )  # fmt: skip
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
                        continue  # a half-width dtype halves bytes: it matters where they dominate
                    yield from measure_cell(
                        plan, workload, d_model, dtype, concurrency, requests, endpoints
                    )
    finally:
        unary.close()
        chunked.close()
        floor_channel.close()
        service_channel.close()
