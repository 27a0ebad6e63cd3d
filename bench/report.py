"""The benchmark's outputs: what each endpoint is, a markdown table, PNG plots. The
targets judged from a run: targets.py."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from tokembed.bench.kinds import ENDPOINTS as KIND_ENDPOINTS
from tokembed.bench.plan import Cell, Results
from tokembed.bench.targets import MB, Target, evaluate_v2_targets, ratio

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
        (target, what, ratio(c.run.percentile_ms(50), floor_p50))
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
