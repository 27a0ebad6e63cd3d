"""The tiny c=1 steps from the floor to the service: each step's p50 over the floor's."""

from __future__ import annotations

import numpy as np

from tokembed.bench.plan import QUICK, Cell, Results
from tokembed.bench.report import LATENCY_STEPS, latency_steps, markdown
from tokembed.bench.runner import Run
from tokembed.bench.targets import MB, evaluate_targets


def tiny_cell(target: str, p50_ms: float, d: int = 512) -> Cell:
    run = Run(requests=3, errors=0, wall_s=1.0, latencies_s=np.full(3, p50_ms / 1000))
    return Cell(
        target=target, workload="tiny", shape="[1,8]", d_model=d, dtype="float32",
        concurrency=1, run=run, tokens_per_request=8.0, bytes_per_request=8 * d * 4,
    )  # fmt: skip


def results_with(cells: list[Cell]) -> Results:
    return Results(plan=QUICK, cells=cells, weights_bytes={512: int(100 * MB)})


STEP_P50_MS = {"floor": 0.5, "floor-deadline": 0.52, "service-bare": 0.6, "service-sync": 0.65}


def test_each_step_is_its_p50_over_the_floors_in_order() -> None:
    results = results_with([tiny_cell(t, p50) for t, p50 in reversed(STEP_P50_MS.items())])
    steps = latency_steps(results, 512)
    assert steps is not None
    assert [target for target, _, _ in steps] == [t for t, _ in LATENCY_STEPS]
    ratios = [ratio for _, _, ratio in steps]
    assert np.allclose(ratios, [1.0, 1.04, 1.2, 1.3])
    table = markdown(results, evaluate_targets(results), "tokembed bench")
    assert "## Tiny [1,8] at concurrency 1, step by step" in table
    assert "| 512 | + tokembed's server (bare client, same request bytes and deadline) " \
           "| service-bare | 1.20 |" in table  # fmt: skip


def test_no_steps_unless_the_run_measured_every_one() -> None:
    cells = [tiny_cell(t, p50) for t, p50 in STEP_P50_MS.items() if t != "floor-deadline"]
    results = results_with(cells)
    assert latency_steps(results, 512) is None
    assert "step by step" not in markdown(results, evaluate_targets(results), "tokembed bench")
