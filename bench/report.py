"""The benchmark's outputs: the targets, a markdown table, PNG plots."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokembed.bench.kinds import BATCHING_CONCURRENCY
from tokembed.bench.kinds import ENDPOINTS as KIND_ENDPOINTS
from tokembed.bench.plan import TARGETS_D_MODEL, Cell, Results

MB = 1e6

# What each endpoint of a cell is (bench/cells.py measures them), in the order the cells
# come; printed before a run, and written into its table. docs/benchmarks/README.md has a
# row for each (tests/bench/test_bench_outputs.py checks it).
ENDPOINTS: dict[str, str] = {
    "floor": "a bare gRPC endpoint (bench/floor.py) answering a pre-encoded response of the "
    "same size, called by a bare gRPC client with no deadline: what any Python gRPC service "
    "costs at least. Targets are ratios to it",
    "floor-deadline": "the floor called with the deadline the tokembed clients send "
    "(tiny [1,8] at concurrency 1 only)",
    "service-bare": "tokembed serve's Embed called by a bare gRPC client: the floor's request "
    "bytes and the clients' deadline, no decoding (tiny [1,8] at concurrency 1 only)",
    "service-sync": "tokembed serve through the sync client (EmbeddingClient), unary Embed",
    "service-async": "tokembed serve through the asyncio client (AsyncEmbeddingClient), "
    "unary Embed",
    "service-chunked": "the sync client with EmbedChunked (1 MiB slices; what the client "
    "uses above 16 MiB), for answers of 4 MiB and more",
    "service-stream": "one EmbedStream per request through the sync client, for answers "
    "under 4 MiB",
    "no-batching": "a second tokembed serve with --max-batch-tokens 1, asyncio client (only "
    "the onnxruntime backend batches: with the table backend, the default on CPU, it is the "
    "service again)",
    "ceiling": "the service's own look-up (its backend, loaded as tokembed serve loads the "
    "model) called in the bench's process, the answer's bytes made once: no transport, no "
    "request parsing, no client. What the service could reach if those cost nothing",
    **KIND_ENDPOINTS,
}


# The V2 section's endpoints (bench/v2.py); docs/benchmarks/README.md has a row for each.
V2_ENDPOINTS: dict[str, str] = {
    "v2": "tokembed serve's Open Inference Protocol front end (inference.GRPCInferenceService "
    "ModelInfer), through tritonclient's asyncio client",
    "v1": "the same server's tokembed.v1 Embed, through tokembed's own asyncio client "
    "(tritonclient does not speak tokembed.v1)",
    "mlserver": "MLServer 1.7.1 from PyPI in a virtual environment of its own, the same "
    "model.onnx through onnxruntime (one intra-op thread), adaptive batching (32 requests, "
    "2 ms), through tritonclient's asyncio client",
    "v2-shm": "tokembed V2 with the ids and the answer in system shared-memory regions "
    "(tritonclient.utils.shared_memory, registered once), large answers only",
    "floor": "the bare gRPC floor (bench/floor.py), bare client: a unary answer of the same "
    "size, large answers only",
    "ceiling": "the service's own look-up in the bench's process, large answers only",
}


def legend(columns: int = 100) -> list[str]:
    """Each endpoint's name, then what it is, wrapped to ``columns``."""
    width = max(len(name) for name in ENDPOINTS) + 2
    lines: list[str] = []
    for name, what in ENDPOINTS.items():
        lines += textwrap.wrap(
            what,
            width=max(columns, width + 30),
            initial_indent=f"{name:{width}s}",
            subsequent_indent=" " * width,
        )
    return lines


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


def _ratio(a: float, b: float) -> float:
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
    return Target(name, wanted, _ratio(a, b), threshold, higher, detail)


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


# Tiny requests at concurrency 1, from the floor to the service one step at a time (the
# harness measures the middle two only there): what the deadline, tokembed's server and
# tokembed's client each add to the p50 that the first target compares.
LATENCY_STEPS = (
    ("floor", "the floor, bare client, no deadline"),
    ("floor-deadline", "+ the deadline the tokembed clients send"),
    ("service-bare", "+ tokembed's server (bare client, same request bytes and deadline)"),
    ("service-sync", "+ tokembed's sync client (the first target's figure)"),
)


def latency_steps(results: Results, d_model: int) -> list[tuple[str, str, float]] | None:
    """``(target, what, p50 / floor p50)`` for each step at width ``d_model``; None
    unless the run measured them all."""
    found = [results.find(t, "tiny", d_model, "float32", 1) for t, _ in LATENCY_STEPS]
    cells = [c for c in found if c is not None and c.run.requests]
    if len(cells) != len(LATENCY_STEPS):
        return None
    floor_p50 = cells[0].run.percentile_ms(50)
    return [
        (target, what, _ratio(c.run.percentile_ms(50), floor_p50))
        for (target, what), c in zip(LATENCY_STEPS, cells, strict=True)
    ]


def _latency_steps_markdown(results: Results) -> list[str]:
    lines: list[str] = []
    for d in sorted(results.weights_bytes):
        steps = latency_steps(results, d)
        if steps is None:
            continue
        if not lines:
            lines += [
                "",
                "## Tiny [1,8] at concurrency 1, step by step",
                "",
                "p50 of each step over the floor's p50; the four were measured in turns.",
                "",
                "| D | step | cell | p50 / floor p50 |",
                "|---|---|---|---|",
            ]
        lines += [f"| {d} | {what} | {target} | {ratio:.2f} |" for target, what, ratio in steps]
    return lines


def _rss_bound(results: Results, cell: Cell) -> float:
    inflight = cell.concurrency * cell.bytes_per_request
    return results.weights_bytes[cell.d_model] + 2 * inflight + 150 * MB


def markdown(results: Results, targets: list[Target], command: str) -> str:
    lines = [
        "# tokembed benchmark",
        "",
        f"Command: `{command}`  ",
        "Machine: " + ", ".join(f"{k}={v}" for k, v in results.environment.items()) + "  ",
        "All figures from one run, side by side; ratios are what to read (the machine is "
        "shared and absolute timings drift).",
    ]
    if results.cells:  # the main section (a --v2 run has the V2 section alone)
        lines += [
            "",
            "## Targets",
            "",
            "| target | wanted | measured | verdict | detail |",
            "|---|---|---|---|---|",
        ]
        for t in targets:
            measured = (
                "n/a" if t.measured is None or math.isnan(t.measured) else f"{t.measured:.2f}"
            )
            lines.append(f"| {t.name} | {t.wanted} | {measured} | {t.verdict} | {t.detail} |")
        lines += _latency_steps_markdown(results)
    if results.v2_cells or results.v2_notes:
        lines += _v2_markdown(results)
    if results.cells:
        lines += ["", "## Endpoints", "", "| endpoint | what |", "|---|---|"]
        lines += [f"| `{name}` | {what} |" for name, what in ENDPOINTS.items()]
        lines += ["", "## All cells", "", *_CELL_HEADER]
        lines += _cell_rows(results.cells)
    return "\n".join(lines) + "\n"


def _v2_markdown(results: Results) -> list[str]:
    lines = [
        "",
        "## V2 (the Open Inference Protocol)",
        "",
        "Each group of cells measured in turns; tokembed V2 and MLServer through the same "
        "client (tritonclient's asyncio client), tokembed v1 through its own.",
        *(["", *[f"- {note}" for note in results.v2_notes]] if results.v2_notes else []),
        "",
        "| target | wanted | measured | verdict | detail |",
        "|---|---|---|---|---|",
    ]
    for t in evaluate_v2_targets(results):
        measured = "n/a" if t.measured is None or math.isnan(t.measured) else f"{t.measured:.2f}"
        lines.append(f"| {t.name} | {t.wanted} | {measured} | {t.verdict} | {t.detail} |")
    lines += ["", "| endpoint | what |", "|---|---|"]
    lines += [f"| `{name}` | {what} |" for name, what in V2_ENDPOINTS.items()]
    lines += ["", *_CELL_HEADER]
    lines += _cell_rows(results.v2_cells)
    return lines


_CELL_HEADER = (
    "| target | workload | D | dtype | conc | req/s | tokens/s | MB/s | p50 ms | p99 ms "
    "| server CPU ms/req | server peak RSS MB | errors | notes |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
)


def _cell_rows(cells: list[Cell]) -> list[str]:
    lines = []
    for c in cells:
        cpu = (
            ""
            if math.isnan(c.server_cpu_s_per_request)
            else f"{c.server_cpu_s_per_request * 1000:.3f}"
        )
        rss = f"{c.server_peak_rss_bytes / MB:,.0f}" if c.server_peak_rss_bytes else ""
        lines.append(
            f"| {c.target} | {c.workload} {c.shape} | {c.d_model} | {c.dtype} | {c.concurrency} "
            f"| {c.run.rps:,.1f} | {c.tokens_per_s:,.0f} | {c.mb_per_s:,.1f} "
            f"| {c.run.percentile_ms(50):.3f} | {c.run.percentile_ms(99):.3f} | {cpu} | {rss} "
            f"| {c.run.errors} | {c.notes} |"
        )
    return lines


def plots(results: Results, out_dir: Path) -> list[Path]:
    """Latency against concurrency, throughput against payload size (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written: list[Path] = []
    d = min(results.weights_bytes) if results.weights_bytes else 512
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for target in ("floor", "service-sync", "service-async", "no-batching"):
        cells = sorted(
            (
                c
                for c in results.cells
                if c.target == target
                and c.workload == "tiny"
                and c.d_model == d
                and c.dtype == "float32"
            ),
            key=lambda c: c.concurrency,
        )
        if cells:
            ax.plot([c.concurrency for c in cells], [c.run.percentile_ms(50) for c in cells],
                    marker="o", label=f"{target} p50")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("latency, ms (tiny [1,8])")
    ax.set_title(f"Latency against concurrency, D={d}")
    ax.legend()
    path = out_dir / "latency_vs_concurrency.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for target in ("floor", "service-sync", "service-chunked", "ceiling"):
        cells = sorted((c for c in results.cells if c.target == target and c.concurrency == 1
                        and c.dtype == "float32"), key=lambda c: c.bytes_per_request)  # fmt: skip
        if cells:
            ax.plot([c.bytes_per_request / MB for c in cells], [c.mb_per_s for c in cells],
                    marker="o", label=target)  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("answer size, MB")
    ax.set_ylabel("throughput, MB/s (concurrency 1)")
    ax.set_title("Throughput against payload size")
    ax.legend()
    path = out_dir / "throughput_vs_payload.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written
