"""The targets a benchmark run is judged by: each a ratio of two cells measured in the same
run (docs/benchmarks/README.md says why), against its threshold."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tokembed.bench.kinds import BATCHING_CONCURRENCY
from tokembed.bench.plan import TARGETS_D_MODEL, Cell, Results

MB = 1e6


@dataclass(frozen=True)
class Target:
    name: str
    wanted: str
    measured: float | None  # the ratio (or bytes for the RSS bound)
    threshold: float
    higher_is_better: bool
    detail: str

    @property
    def met(self) -> bool | None:
        if self.measured is None or math.isnan(self.measured):
            return None
        if self.higher_is_better:
            return self.measured >= self.threshold
        return self.measured <= self.threshold

    @property
    def verdict(self) -> str:
        return {True: "met", False: "MISSED", None: "not measured"}[self.met]


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) and not math.isnan(a) else float("nan")


def evaluate_targets(results: Results) -> list[Target]:
    d = TARGETS_D_MODEL
    find = results.find
    targets: list[Target] = []

    floor_tiny_1 = find("floor", "tiny", d, "float32", 1)
    svc_tiny_1 = find("service-sync", "tiny", d, "float32", 1)
    targets.append(_target(
        "tiny [1,8], concurrency 1: service p50 / floor p50", "<= 1.30", 1.30, False,
        svc_tiny_1, floor_tiny_1, lambda c: c.run.percentile_ms(50), "ms p50",
    ))  # fmt: skip

    floor_tiny_64 = find("floor", "tiny", d, "float32", 64)
    best_64 = _best(results, "tiny", d, "float32", 64, ("service-async", "service-sync"))
    targets.append(_target(
        "tiny [1,8], concurrency 64: service req/s / floor req/s", ">= 0.85", 0.85, True,
        best_64, floor_tiny_64, lambda c: c.run.rps, "req/s",
    ))  # fmt: skip

    large_c = min(c for c in results.plan.concurrencies)
    floor_large = find("floor", "large", d, "float32", large_c)
    svc_large = _best(results, "large", d, "float32", large_c, ("service-sync", "service-async"))
    targets.append(_target(
        f"large [32,512] float32, concurrency {large_c}: service unary MB/s / floor MB/s",
        ">= 0.80", 0.80, True, svc_large, floor_large, lambda c: c.mb_per_s, "MB/s",
    ))  # fmt: skip

    chunked = find("service-chunked", "large", d, "float32", large_c)
    targets.append(_target(
        f"large [32,512] float32, concurrency {large_c}: chunked stream MB/s / floor unary MB/s",
        ">= 1.4", 1.4, True, chunked, floor_large, lambda c: c.mb_per_s, "MB/s",
    ))  # fmt: skip

    best16 = _best(results, "large", d, "float16", large_c,
                   ("service-chunked", "service-sync", "service-async"))  # fmt: skip
    best32 = _best(results, "large", d, "float32", large_c,
                   ("service-chunked", "service-sync", "service-async"))  # fmt: skip
    targets.append(_target(
        f"large [32,512], concurrency {large_c}: float16 tokens/s / float32 tokens/s",
        ">= 1.8", 1.8, True, best16, best32, lambda c: c.tokens_per_s, "tokens/s",
    ))  # fmt: skip
    best_bf16 = _best(results, "large", d, "bfloat16", large_c,
                      ("service-chunked", "service-sync", "service-async"))  # fmt: skip
    targets.append(_target(
        f"large [32,512], concurrency {large_c}: bfloat16 tokens/s / float32 tokens/s",
        ">= 1.8", 1.8, True, best_bf16, best32, lambda c: c.tokens_per_s, "tokens/s",
    ))  # fmt: skip

    targets.append(_target(
        "factorized model from its table, large [32,512] float32, concurrency 1: tokens/s / "
        "a token model's table of the same V and D", ">= 0.90", 0.90, True,
        find("factorized-table", "large", d, "float32", 1),
        find("token-table", "large", d, "float32", 1), lambda c: c.tokens_per_s, "tokens/s",
    ))  # fmt: skip
    callers = BATCHING_CONCURRENCY
    targets.append(_target(
        f"factorized model per batch, tiny [1,8] float32, concurrency {callers}: batched "
        "tokens/s / unbatched", ">= 2.0", 2.0, True,
        find("factorized-batched", "tiny", d, "float32", callers),
        find("factorized-unbatched", "tiny", d, "float32", callers), lambda c: c.tokens_per_s,
        "tokens/s",
    ))  # fmt: skip
    targets.append(_rss_target(results))
    return targets


def evaluate_v2_targets(results: Results) -> list[Target]:
    """The V2 section's targets (issue 26's table), from its cells at D=512, float32."""

    def find(target: str, workload: str, concurrency: int) -> Cell | None:
        cell = results.find(target, workload, TARGETS_D_MODEL, "float32", concurrency, v2=True)
        return cell if cell is not None and cell.run.requests else None

    def rps(c: Cell) -> float:
        return c.run.rps

    def mbps(c: Cell) -> float:
        return c.mb_per_s

    def p50(c: Cell) -> float:
        return c.run.percentile_ms(50)

    return [
        _target("V2: tiny [1,8] c=1: tokembed V2 req/s / MLServer req/s", ">= 4", 4.0, True,
                find("v2", "tiny", 1), find("mlserver", "tiny", 1), rps, "req/s"),
        _target("V2: tiny [1,8] c=32: tokembed V2 req/s / MLServer req/s", ">= 2", 2.0, True,
                find("v2", "tiny", 32), find("mlserver", "tiny", 32), rps, "req/s"),
        _target("V2: [8,128] c=1: tokembed V2 MB/s / MLServer MB/s", ">= 10", 10.0, True,
                find("v2", "medium", 1), find("mlserver", "medium", 1), mbps, "MB/s"),
        _target("V2: [8,128] c=8: tokembed V2 MB/s / MLServer MB/s", ">= 10", 10.0, True,
                find("v2", "medium", 8), find("mlserver", "medium", 8), mbps, "MB/s"),
        _target("V2: tiny [1,8] c=1: tokembed V2 p50 / tokembed v1 p50", "<= 1.25", 1.25,
                False, find("v2", "tiny", 1), find("v1", "tiny", 1), p50, "ms p50"),
        _target("V2: large [32,512] float32 c=1: shared memory MB/s / gRPC floor unary MB/s",
                ">= 4", 4.0, True, find("v2-shm", "large", 1), find("floor", "large", 1),
                mbps, "MB/s"),
        _target("V2: large [32,512] float32 c=1: shared memory MB/s / in-process look-up MB/s",
                ">= 0.5", 0.5, True, find("v2-shm", "large", 1), find("ceiling", "large", 1),
                mbps, "MB/s"),
    ]  # fmt: skip


def _best(results: Results, workload: str, d: int, dtype: str, concurrency: int,
          names: tuple[str, ...]) -> Cell | None:  # fmt: skip
    cells = [results.find(n, workload, d, dtype, concurrency) for n in names]
    present = [c for c in cells if c is not None and c.run.requests]
    return max(present, key=lambda c: c.run.rps) if present else None


def _target(
    name: str,
    wanted: str,
    threshold: float,
    higher: bool,
    ours: Cell | None,
    ref: Cell | None,
    metric: Callable[[Cell], float],
    unit: str,
) -> Target:
    if ours is None or ref is None:
        return Target(name, wanted, None, threshold, higher, "not in this run's plan")
    a, b = metric(ours), metric(ref)
    detail = f"{ours.target} {a:,.3f} vs {ref.target} {b:,.3f} {unit}"
    return Target(name, wanted, ratio(a, b), threshold, higher, detail)


def _rss_target(results: Results) -> Target:
    """Every service cell's peak RSS against the bound for its own load, at every width.

    The bound is weights + 2 x (concurrency x answer bytes) + 150 MB; the weights are what
    the server keeps of the model (harness._served_weights_bytes): its row tables with the
    table backend, the model's weights with the onnxruntime backend. Before a cell lighter
    than the one before it the harness waits for the server's heap trim, so each peak is
    the cell's own.
    """
    name = "server peak RSS under load <= weights + 2 x in-flight output + 150 MB"
    cells = [
        c
        for c in results.cells
        if c.target.startswith("service")
        and c.server_peak_rss_bytes
        and c.d_model in results.weights_bytes
    ]
    if not cells:
        return Target(name, "<= 1.0 of the bound, every cell", None, 1.0, False, "not measured")
    ratios = [(c.server_peak_rss_bytes / _rss_bound(results, c), c) for c in cells]
    worst_ratio, worst = max(ratios, key=lambda pair: pair[0])
    over = sum(1 for ratio, _ in ratios if ratio > 1.0)
    detail = (
        f"worst cell {worst.target} {worst.workload} D={worst.d_model} {worst.dtype} "
        f"c={worst.concurrency}: peak {worst.server_peak_rss_bytes / MB:,.0f} MB, bound "
        f"{_rss_bound(results, worst) / MB:,.0f} MB = weights "
        f"{results.weights_bytes[worst.d_model] / MB:,.0f} + 2 x "
        f"{worst.concurrency * worst.bytes_per_request / MB:,.0f} in flight + 150; "
        f"{over} of {len(cells)} service cells over their bound"
    )
    return Target(name, "<= 1.0 of the bound, every cell", worst_ratio, 1.0, False, detail)


def _rss_bound(results: Results, cell: Cell) -> float:
    inflight = cell.concurrency * cell.bytes_per_request
    return results.weights_bytes[cell.d_model] + 2 * inflight + 150 * MB
