"""The V2 section of ``tokembed bench``: the Open Inference Protocol, measured side by side.

Endpoints (``report.V2_ENDPOINTS`` says the same to the reader):
- ``v2``:        tokembed serve's ``inference.GRPCInferenceService`` (ModelInfer), through
                 tritonclient's asyncio client;
- ``v1``:        the same server's ``tokembed.v1`` Embed, through tokembed's own asyncio
                 client (tritonclient does not speak tokembed.v1);
- ``mlserver``:  MLServer 1.7.1 from PyPI (``bench/mlserver.py``: onnxruntime, adaptive
                 batching), through tritonclient's asyncio client; skipped with a message
                 when it cannot be installed or started;
- ``v2-shm``:    tokembed V2 with the ids and the answer in system shared-memory regions
                 (``tritonclient.utils.shared_memory``), large answers only;
- ``floor``:     the bare gRPC endpoint of ``bench/floor.py`` (large answers only: the gRPC
                 floor for a unary answer of that size);
- ``ceiling``:   the service's own look-up in this process (large answers only).

Every group of cells a target compares is measured in turns (``runner.run_interleaved``):
tiny [1,8] at concurrency 1 and 32, [8,128] at 1 and 8, large [32,512] at 1, D=512,
float32.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from tokembed.bench import floor as floor_module
from tokembed.bench import mlserver, processes
from tokembed.bench.ceiling import Ceiling, ceiling_ids, load_backend
from tokembed.bench.cells import CLIENT_MESSAGE_BYTES, CLIENT_TIMEOUT_S
from tokembed.bench.plan import Cell, Plan
from tokembed.bench.runner import AsyncTurns, Run, Turn, run_interleaved, threaded_turns
from tokembed.bench.workloads import LARGE, MEDIUM, TINY, Workload
from tokembed.client import AsyncEmbeddingClient, codec

D_MODEL = 512
DTYPE = "float32"


@dataclass(frozen=True)
class Group:
    """Cells measured in turns with each other."""

    workload: Workload
    concurrency: int
    endpoints: tuple[str, ...]
    time_factor: int  # this many times a cell's time for each endpoint
    rounds: int


GROUPS = (
    # p50 against p50 close together: many short turns, as the main section's tiny c=1.
    Group(TINY, 1, ("v2", "v1", "mlserver"), time_factor=2, rounds=12),
    # Ratios of throughputs far apart, the slower side slow ([8,128]): twice a cell's time
    # in 6 turns, so that each turn of MLServer's holds more than a few calls (with 4
    # turns of one cell's time the ratio wandered: docs/benchmarks/README.md).
    Group(TINY, 32, ("v2", "v1", "mlserver"), time_factor=2, rounds=6),
    Group(MEDIUM, 1, ("v2", "v1", "mlserver"), time_factor=2, rounds=6),
    Group(MEDIUM, 8, ("v2", "v1", "mlserver"), time_factor=2, rounds=6),
    Group(
        LARGE, 1, ("v2-shm", "v2", "v1", "mlserver", "floor", "ceiling"), time_factor=2, rounds=6
    ),
)


def run_v2(
    plan: Plan,
    model_dir: Path,
    *,
    server_args: list[str],
    server_env: Mapping[str, str] | None,
    mlserver_venv: Path | None,
    progress: Callable[[str], None] = print,
) -> tuple[list[Cell], list[str]]:
    """Every group's cells, and notes for the reader (what was skipped, and why)."""
    try:
        import tritonclient.grpc.aio  # noqa: F401
    except ImportError as exc:
        return [], [f"V2 section skipped: tritonclient is not installed ({exc})"]
    notes: list[str] = []
    cells: list[Cell] = []
    with ExitStack() as stack:
        service = stack.enter_context(
            processes.service(str(model_dir), *server_args, "--shared-memory", "system",
                              env=server_env)
        )  # fmt: skip
        floor_proc = stack.enter_context(processes.floor(D_MODEL))
        mlserver_target = None
        if mlserver_venv is None:
            notes.append("MLServer skipped: --no-mlserver")
        else:
            try:
                python = mlserver.ensure_venv(mlserver_venv, progress)
                repository = mlserver.model_repository(
                    mlserver_venv.parent / "mlserver-models",
                    _model_name(model_dir),
                    model_dir / "model.onnx",
                )
                child = stack.enter_context(mlserver.mlserver(python, repository))
                mlserver_target = child.target
            except (mlserver.MLServerUnavailable, RuntimeError) as exc:
                notes.append(f"MLServer skipped: {exc}")
                progress(notes[-1])
        backend = load_backend(model_dir, "cpu")
        options = [
            ("grpc.max_receive_message_length", CLIENT_MESSAGE_BYTES),
            ("grpc.max_send_message_length", CLIENT_MESSAGE_BYTES),
        ]
        floor_channel = stack.enter_context(grpc.insecure_channel(floor_proc.target, options))
        floor_call = floor_channel.unary_unary(floor_module.METHOD)
        targets = {"v2": service.target, "v1": service.target, "v2-shm": service.target}
        if mlserver_target is not None:
            targets["mlserver"] = mlserver_target
        for group in GROUPS:
            for cell in _measure_group(
                plan, group, _model_name(model_dir), targets, floor_call, backend
            ):
                cells.append(cell)
                progress(_line(cell))
    return cells, notes


def _model_name(model_dir: Path) -> str:
    from tokembed.export.manifest import Manifest

    return Manifest.read(model_dir).name


def _measure_group(
    plan: Plan,
    group: Group,
    model: str,
    targets: Mapping[str, str],
    floor_call: Any,
    backend: Any,
) -> Iterator[Cell]:
    rng = np.random.default_rng(1234)
    requests = [group.workload.make_ids(rng, 32000) for _ in range(16)]
    answer_bytes = float(group.workload.output_rows() * D_MODEL * 4)
    max_requests = int(min(plan.max_requests, max(20, 1.5e9 // answer_bytes)))
    names = [name for name in group.endpoints if name in targets or name in ("floor", "ceiling")]
    with ExitStack() as stack:
        turns: dict[str, Turn] = {}
        for name in names:
            if name == "floor":
                encoded = [codec.encode_request(codec.encode_ids(r), dtype=DTYPE, layout="padded")
                           for r in requests]  # fmt: skip
                turns[name] = threaded_turns(floor_call, encoded, concurrency=group.concurrency)
            elif name == "ceiling":
                ceiling = Ceiling(backend, DTYPE)

                def look_up(ids: Any, ceiling: Ceiling = ceiling) -> object:
                    return ceiling(ids)

                turns[name] = threaded_turns(
                    look_up, [ceiling_ids(r) for r in requests], concurrency=group.concurrency
                )
            else:
                endpoint = _endpoint(name, targets[name], model, group.workload)
                loop = stack.enter_context(AsyncTurns(setup=endpoint.open,
                                                      teardown=endpoint.close))  # fmt: skip
                turns[name] = loop.turns(endpoint.call, requests, concurrency=group.concurrency)
        runs = run_interleaved(
            turns, duration_s=group.time_factor * plan.duration_s,
            max_requests=group.time_factor * max_requests, rounds=group.rounds,
        )  # fmt: skip
    for name in names:
        yield _cell(name, group, runs[name], answer_bytes)


def _cell(name: str, group: Group, run: Run, answer_bytes: float) -> Cell:
    workload = group.workload
    return Cell(
        target=name, workload=workload.name, shape=workload.shape_text, d_model=D_MODEL,
        dtype=DTYPE, concurrency=group.concurrency, run=run,
        tokens_per_request=float(workload.tokens()), bytes_per_request=answer_bytes,
        notes="V2 section; in turns",
    )  # fmt: skip


def _line(cell: Cell) -> str:
    errors = f" errors={cell.run.errors} ({cell.run.first_error[:80]})" if cell.run.errors else ""
    return (
        f"{cell.target:16s} {cell.workload:8s} {cell.d_model:5d} {cell.dtype:8s} "
        f"{cell.concurrency:4d} {cell.run.rps:9.1f} {cell.mb_per_s:9.1f} "
        f"{cell.run.percentile_ms(50):9.3f} {cell.run.percentile_ms(99):9.3f}{errors}"
    )


# --- the clients


class _Endpoint:
    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def call(self, ids: Any) -> object:
        raise NotImplementedError


def _endpoint(name: str, target: str, model: str, workload: Workload) -> _Endpoint:
    if name == "v1":
        return _TokembedV1(target, model)
    if name == "v2-shm":
        return _Triton(target, model, workload)
    return _Triton(target, model, None)


class _TokembedV1(_Endpoint):
    def __init__(self, target: str, model: str) -> None:
        self._target = target
        self._model = model
        self._client: AsyncEmbeddingClient | None = None

    async def open(self) -> None:
        self._client = AsyncEmbeddingClient(
            self._target, chunked_threshold_bytes=None, max_message_bytes=CLIENT_MESSAGE_BYTES,
            timeout_s=CLIENT_TIMEOUT_S, model_name=self._model,
        )  # fmt: skip

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def call(self, ids: Any) -> object:
        assert self._client is not None
        return await self._client.embed(ids, DTYPE)


class _Triton(_Endpoint):
    """tritonclient's asyncio client; with ``shared_memory`` (a workload), the ids and the
    answer go through two system shared-memory regions registered once."""

    def __init__(self, target: str, model: str, shared_memory: Workload | None) -> None:
        self._target = target
        self._model = model
        self._workload = shared_memory
        self._client: Any = None
        self._regions: list[tuple[str, Any]] = []
        tag = f"tokembed_bench_{os.getpid()}_{secrets.token_hex(4)}"
        self._names = (f"{tag}_ids", f"{tag}_answer")

    async def open(self) -> None:
        import tritonclient.grpc.aio as triton
        import tritonclient.utils.shared_memory as shm

        self._client = triton.InferenceServerClient(self._target)
        if self._workload is None:
            return
        sizes = (self._workload.tokens() * 8, self._workload.output_rows() * D_MODEL * 4)
        for name, size in zip(self._names, sizes, strict=True):
            handle = shm.create_shared_memory_region(name, f"/{name}", size)
            self._regions.append((name, handle))
            await self._client.register_system_shared_memory(name, f"/{name}", size)

    async def close(self) -> None:
        import tritonclient.utils.shared_memory as shm

        if self._client is None:
            return
        for name, handle in self._regions:
            await self._client.unregister_system_shared_memory(name)
            shm.destroy_shared_memory_region(handle)
        self._regions.clear()
        await self._client.close()

    async def call(self, ids: Any) -> object:
        import tritonclient.grpc.aio as triton
        import tritonclient.utils.shared_memory as shm

        given = triton.InferInput("input_ids", list(ids.shape), "INT64")
        wanted = triton.InferRequestedOutput("hidden_states")
        if not self._regions:
            given.set_data_from_numpy(ids)
            result = await self._client.infer(self._model, [given], outputs=[wanted])
            return result.as_numpy("hidden_states")
        (ids_name, ids_region), (answer_name, answer_region) = self._regions
        shm.set_shared_memory_region(ids_region, [ids])
        given.set_shared_memory(ids_name, ids.nbytes)
        answer_bytes = ids.size * D_MODEL * 4
        wanted.set_shared_memory(answer_name, answer_bytes)
        result = await self._client.infer(self._model, [given], outputs=[wanted])
        shape = result.get_output("hidden_states").shape
        return shm.get_contents_as_numpy(answer_region, np.float32, shape)
