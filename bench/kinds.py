"""The bench's model-kind cells: a factorized model (ALBERT's ``E [V, D']`` then a
projection to D) served each way, against a plain token model of the same V and D.

- From its table: the ``[V, D]`` rows computed at load make a factorized model a table
  look-up like any other; large [32,512] float32 requests at concurrency 1 through the
  sync client, in turns with the plain token model's service.
- Per batch (``--float32-table-max-bytes 0``): the model runs per batch, a matmul. Tiny
  [1,8] float32 requests at concurrency 16 through the asyncio client, in turns with a
  second such service that does not batch (``--max-batch-tokens 1``): what batching buys
  when each run has a fixed cost. (For larger requests a run's cost is its matmul, which
  batching does not shrink: docs/benchmarks/README.md, "Model kinds".)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tokembed.bench import processes
from tokembed.bench.cells import CLIENT_MESSAGE_BYTES, CLIENT_TIMEOUT_S, _CellMeasure
from tokembed.bench.meters import TurnsMeter
from tokembed.bench.plan import TARGETS_D_MODEL, Cell, Plan
from tokembed.bench.runner import AsyncTurns, Run, Turn, run_interleaved, threaded_turns
from tokembed.bench.workloads import LARGE, TINY, Workload
from tokembed.client import AsyncEmbeddingClient, EmbeddingClient

VOCAB_SIZE = 32000
FACTOR_DIM = 128  # ALBERT's embedding_size
BATCHING_CONCURRENCY = 16
# Both comparisons are measured in turns: a cell's time 3 times over, in 6 turns each.
_TIME_FACTOR, _ROUNDS = 3, 6

# The endpoints of these cells, for report.ENDPOINTS.
ENDPOINTS: dict[str, str] = {
    "token-table": "a token model (E [V,D], V=32000, D=512) served from its table by "
    "tokembed serve, sync client: the reference of the factorized model served from its table",
    "factorized-table": "a factorized model (E [V,128] projected to D=512, ALBERT's kind) "
    "served from the [V,D] table it computed at load, sync client",
    "factorized-batched": "the same factorized model run per batch (--float32-table-max-bytes "
    "0: a matmul a batch), asyncio client",
    "factorized-unbatched": "the same, run per request (--max-batch-tokens 1), asyncio client",
}


def ensure_factorized_model(cache_dir: Path, d_model: int = TARGETS_D_MODEL) -> Path:
    """The bench's factorized model (V=32000, D'=128, seed 0), exported once and reused."""
    from tokembed.export.errors import ModelDirError
    from tokembed.export.model_dir import load_model_dir

    directory = cache_dir / f"bench-factorized-v{VOCAB_SIZE}-k{FACTOR_DIM}-d{d_model}"
    try:
        load_model_dir(directory, verify_hashes=False)
        return directory
    except ModelDirError:
        pass
    import torch

    from tokembed.export.modules import FactorizedEmbedding, random_table
    from tokembed.export.pipeline import ExportOptions, export_model

    generator = torch.Generator().manual_seed(1)
    bound = FACTOR_DIM**-0.5  # a Linear's own initialisation
    projection = (torch.rand(d_model, FACTOR_DIM, generator=generator) * 2 - 1) * bound
    bias = (torch.rand(d_model, generator=generator) * 2 - 1) * bound
    module = FactorizedEmbedding(
        random_table(VOCAB_SIZE, FACTOR_DIM, 0, None), projection, bias, scale="none"
    )
    export_model(
        module, ExportOptions(out_dir=directory, name=f"bench-factorized-d{d_model}", force=True)
    )
    return directory


def measure_kinds(
    plan: Plan,
    token_model_dir: Path,
    factorized_dir: Path,
    server_args: list[str],
    server_env: Mapping[str, str] | None,
) -> Iterator[Cell]:
    """The factorized model's cells (module docstring), at the targets' width."""
    d_model = TARGETS_D_MODEL
    per_batch = [*server_args, "--float32-table-max-bytes", "0"]
    with (
        processes.service(str(token_model_dir), *server_args, env=server_env) as token,
        processes.service(str(factorized_dir), *server_args, env=server_env) as table,
    ):
        services = {"token-table": token, "factorized-table": table}
        yield from _in_turns(plan, LARGE, d_model, 1, services, asyncio=False)
    with (
        processes.service(str(factorized_dir), *per_batch, env=server_env) as batched,
        processes.service(
            str(factorized_dir), *per_batch, "--max-batch-tokens", "1", env=server_env
        ) as unbatched,
    ):
        services = {"factorized-batched": batched, "factorized-unbatched": unbatched}
        yield from _in_turns(plan, TINY, d_model, BATCHING_CONCURRENCY, services, asyncio=True)


def _in_turns(
    plan: Plan,
    workload: Workload,
    d_model: int,
    concurrency: int,
    services: dict[str, processes.Child],
    asyncio: bool,
) -> Iterator[Cell]:
    """Each service called ``concurrency`` at a time with ``workload``'s float32 requests,
    in turns; through the asyncio client, or the sync one."""
    rng = np.random.default_rng(1234)
    requests = [workload.make_ids(rng, VOCAB_SIZE) for _ in range(16)]
    measure = _CellMeasure(plan, workload, d_model, "float32", concurrency, requests)
    options: dict[str, Any] = {
        "chunked_threshold_bytes": None,
        "max_message_bytes": CLIENT_MESSAGE_BYTES,
        "timeout_s": CLIENT_TIMEOUT_S,
    }
    aio: dict[str, AsyncEmbeddingClient] = {}

    async def open_clients() -> None:
        aio.update(
            {name: AsyncEmbeddingClient(c.target, **options) for name, c in services.items()}
        )

    async def close_clients() -> None:
        for client in aio.values():
            await client.close()

    sync = (
        {}
        if asyncio
        else {name: EmbeddingClient(c.target, **options) for name, c in services.items()}
    )
    try:
        with (
            AsyncTurns(setup=open_clients, teardown=close_clients)
            if asyncio
            else AsyncTurns() as loop
        ):
            turns: dict[str, Turn] = {
                name: loop.turns(aio[name].embed, requests, concurrency=concurrency, warmup=2)
                if asyncio
                else threaded_turns(sync[name].embed, requests, concurrency=concurrency, warmup=1)
                for name in services
            }
            meters = {name: TurnsMeter(child.pid) for name, child in services.items()}
            runs: dict[str, Run] = run_interleaved(
                turns,
                duration_s=_TIME_FACTOR * plan.duration_s,
                max_requests=_TIME_FACTOR * measure.max_requests,
                rounds=_ROUNDS,
                during=lambda name: meters[name].turn(),
            )
    finally:
        for client in sync.values():
            client.close()
    for name in services:
        yield measure.cell(name, runs[name], meters[name], "in turns")
