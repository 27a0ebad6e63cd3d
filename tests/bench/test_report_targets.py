"""The RSS target is judged per cell, against the bound for that cell's own load."""

from __future__ import annotations

import numpy as np

from tokembed.bench.plan import QUICK, Cell, Results
from tokembed.bench.runner import Run
from tokembed.bench.targets import MB, evaluate_targets


def cell(target: str, concurrency: int, answer_mb: float, peak_mb: float, d: int = 512) -> Cell:
    run = Run(requests=10, errors=0, wall_s=1.0, latencies_s=np.full(10, 0.001))
    return Cell(
        target=target, workload="large", shape="[32,512]", d_model=d, dtype="float32",
        concurrency=concurrency, run=run, tokens_per_request=16384.0,
        bytes_per_request=answer_mb * MB, server_peak_rss_bytes=int(peak_mb * MB),
    )  # fmt: skip


def rss_verdict(cells: list[Cell]) -> tuple[float | None, str]:
    results = Results(
        plan=QUICK, cells=cells, weights_bytes={512: int(100 * MB), 4096: int(800 * MB)}
    )
    (target,) = [t for t in evaluate_targets(results) if t.name.startswith("server peak RSS")]
    return target.measured, target.detail


def test_a_light_cell_is_held_to_its_own_bound_not_the_heaviest_load() -> None:
    # Bound for c=8 x 30 MB: 100 + 480 + 150 = 730; for c=1 x 1 MB: 100 + 2 + 150 = 252.
    heavy = cell("service-sync", 8, 30, 700)
    light = cell("service-async", 1, 1, 300)
    measured, detail = rss_verdict([heavy, light])
    assert measured == 300 / 252
    assert "service-async" in detail and "1 of 2 service cells over" in detail


def test_every_width_counts_and_other_processes_do_not() -> None:
    within = cell("service-sync", 1, 1, 250)
    wide = cell("service-chunked", 1, 10, 1000, d=4096)  # bound 800 + 20 + 150 = 970
    floor = cell("floor", 1, 1, 5000)  # not the service: not judged
    measured, detail = rss_verdict([within, wide, floor])
    assert measured == 1000 / 970
    assert "D=4096" in detail
    measured, _ = rss_verdict([within, floor])
    assert measured is not None and measured < 1.0
