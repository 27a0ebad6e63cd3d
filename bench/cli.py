"""``tokembed bench``: measure the service against its floor and ceiling, in one run.

Where it writes: a full run into ``docs/benchmarks`` (the project keeps its latest full run
there, committed); ``--quick`` into a fresh temporary directory, so that trying it in a
clone leaves no untracked file behind. ``--out`` names another.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokembed.bench.plan import Plan

# Where a full run writes by default: the project's record of its latest run.
FULL_RUN_OUT = Path("docs/benchmarks")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark the service against bare gRPC (floor) and its own look-up in process "
        "(ceiling)",
        description=(
            "Starts the floor (a bare gRPC endpoint answering same-sized payloads) and the "
            "service with and without batching, loads the service's look-up in this process "
            "(the ceiling), and measures them side by side. Prints what each endpoint is, "
            "then a line per cell as it is measured, then the targets; writes a markdown "
            "table (and, for a full run, PNG plots)."
        ),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small plan: tiny and large answers at D=512, no plots (about a minute on "
        "2 cores; CI's smoke test)",
    )
    parser.add_argument(
        "--kinds",
        action="store_true",
        help="add the model kinds' cells (a factorized model from its table and per batch; a "
        "full run has them) to a --quick run",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the table (and plots) go. Default: docs/benchmarks for a full run (the "
        "project's record of its latest run: run it from the checkout's root); a fresh "
        "temporary directory for --quick. Printed at the end",
    )
    parser.add_argument("--cache-dir", type=Path, default=Path("models/bench"),
                        help="where the bench models are exported once and reused")  # fmt: skip
    parser.add_argument(
        "--v2",
        action="store_true",
        help="the V2 section alone: tokembed's Open Inference Protocol front end against "
        "MLServer and tokembed.v1, and system shared memory, at D=512 (a full run "
        "includes it; --quick does not)",
    )
    parser.add_argument(
        "--text",
        action="store_true",
        help="the text section alone: EmbedText through the server, and V2 through shared "
        "memory (16 callers, batches of 64 texts of ~200 characters), against the same "
        "tokenizer's batch encode and table gather in this process, at D=64 and 512",
    )
    parser.add_argument(
        "--no-mlserver",
        action="store_true",
        help="leave MLServer out of the V2 section (its first run installs it from PyPI)",
    )
    parser.add_argument(
        "--mlserver-venv", type=Path, default=None,
        help="where MLServer is installed for the V2 section, once (default: "
        "CACHE_DIR/mlserver-venv); never into tokembed's own environment",
    )  # fmt: skip
    parser.add_argument(
        "--nearest",
        action="store_true",
        help="the nearest section alone: one vector against a synthetic table (default "
        "Llama-3's V=128256, D=4096) in float32 and bfloat16 against the memory floor, and "
        "16 callers of 8 vectors against one in-process multiply (bench/nearest.py)",
    )
    parser.add_argument("--nearest-vocab-size", type=int, default=None, metavar="V")
    parser.add_argument("--nearest-d-model", type=int, default=None, metavar="D")
    parser.add_argument(
        "--nearest-heads",
        default="auto",
        metavar="HEAD[,HEAD]",
        help="the service's --nearest-head values to measure in turns (auto, numpy, "
        "onnxruntime; default auto): numpy,onnxruntime compares the CPU's two multiplies",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--duration-s", type=float, default=None, help="seconds per cell")
    parser.add_argument("--name", default=None, help="file name stem (default bench or quick)")
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the service alone (not the floor or the clients), "
        "added to those the deployment sets (GLIBC_TUNABLES=glibc.malloc.hugetlb=1, as the "
        "images and the Kubernetes manifest do; GLIBC_TUNABLES= clears it); may be given "
        "several times",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import time

    from tokembed.bench import harness, report
    from tokembed.bench import plan as plans
    from tokembed.bench.targets import evaluate_targets, evaluate_v2_targets

    if args.nearest:
        return _run_nearest(args)
    if args.text:
        return _run_text(args)
    plan = plans.QUICK if args.quick else plans.FULL
    if args.duration_s is not None:
        plan = dataclasses.replace(plan, duration_s=args.duration_s)
    if args.kinds:
        plan = dataclasses.replace(plan, kinds=True)
    started = time.perf_counter()
    server_env = dict(plans.DEPLOYMENT_ENV)
    for item in args.server_env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"tokembed bench: error: --server-env wants NAME=VALUE, got {item!r}")
        server_env[name] = value
    print(_plan_line(plan, args.device))
    print("endpoints (each cell measures each of them that applies):")
    columns = min(100, shutil.get_terminal_size().columns) - 2
    print("\n".join("  " + line for line in report.legend(columns)))
    print(
        "each cell's line: endpoint, workload, width D, answer dtype, concurrent callers, "
        "requests/s, MB/s of answers, p50 and p99 latency of a call"
    )
    print()
    mlserver_venv = None
    if not args.no_mlserver:
        mlserver_venv = args.mlserver_venv or args.cache_dir / "mlserver-venv"
    main_section = not args.v2
    v2_section = args.v2 or not args.quick
    results = harness.run_plan(
        plan, args.cache_dir, device=args.device, server_env=server_env,
        main=main_section, v2=v2_section, mlserver_venv=mlserver_venv.resolve()
        if mlserver_venv is not None else None,
    )  # fmt: skip
    main_targets = evaluate_targets(results) if main_section else []
    targets = main_targets + (evaluate_v2_targets(results) if v2_section else [])
    args.out = output_dir(args.out, quick=args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.name or ("v2" if args.v2 else "quick" if args.quick else "bench") + (
        "-cuda" if args.device == "cuda" else ""
    )
    command = "tokembed bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    table = report.markdown(results, main_targets, command.strip())
    (args.out / f"{stem}.md").write_text(table, encoding="utf-8")
    written = report.plots(results, args.out) if main_section and not args.quick else []
    print()
    for target in targets:
        measured = "n/a" if target.measured is None else f"{target.measured:.2f}"
        print(f"{target.verdict:12s} {measured:>6s} (wanted {target.wanted}) {target.name}")
    for d in sorted(results.weights_bytes):
        steps = report.latency_steps(results, d)
        if steps is not None:
            print(f"tiny [1,8] c=1 D={d}, p50 / floor p50, step by step: "
                  + ", ".join(f"{target} {ratio:.2f}" for target, _, ratio in steps))  # fmt: skip
    print(f"\nwrote {args.out / f'{stem}.md'}" + "".join(f", {p}" for p in written)
          + f" in {time.perf_counter() - started:.0f} s")  # fmt: skip
    for note in results.v2_notes:
        print(note)
    errors = sum(c.run.errors for c in [*results.cells, *results.v2_cells])
    if errors:
        print(f"{errors} requests failed during the run (see the errors column)", file=sys.stderr)
        return 1
    return 0


def _run_nearest(args: argparse.Namespace) -> int:
    from tokembed.bench import nearest

    vocab = args.nearest_vocab_size or nearest.LLAMA_VOCAB
    d_model = args.nearest_d_model or nearest.LLAMA_D
    print(f"nearest: V={vocab} D={d_model}, float32 and bfloat16 tables; models in "
          f"{args.cache_dir}")  # fmt: skip
    heads = tuple(head.strip() for head in args.nearest_heads.split(","))
    unknown = [head for head in heads if head not in ("auto", "numpy", "onnxruntime")]
    if unknown:
        print(f"error: --nearest-heads {unknown[0]!r} is not auto, numpy or onnxruntime",
              file=sys.stderr)  # fmt: skip
        return 2
    figures = nearest.run_nearest(
        args.cache_dir, vocab_size=vocab, d_model=d_model, duration_s=args.duration_s or 10.0,
        heads=heads,
    )  # fmt: skip
    out = output_dir(args.out, quick=True) if args.out is None else args.out
    out.mkdir(parents=True, exist_ok=True)
    command = "tokembed bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    path = out / f"{args.name or 'nearest'}.md"
    path.write_text(nearest.markdown(figures, command.strip()), encoding="utf-8")
    for f in figures:
        one = "met" if f.one_vector_ratio <= nearest.ONE_VECTOR_TARGET else "missed"
        many = "met" if f.callers_ratio >= nearest.CALLERS_TARGET else "missed"
        print(f"{one:7s} {f.one_vector_ratio:.2f} (wanted <= {nearest.ONE_VECTOR_TARGET}) "
              f"one vector / memory floor, {f.dtype}, head {f.head}")  # fmt: skip
        print(f"{many:7s} {f.callers_ratio:.2f} (wanted >= {nearest.CALLERS_TARGET}) "
              f"16 callers x 8 / in-process multiply, {f.dtype}, head {f.head}")  # fmt: skip
        if f.int8_ratio is not None:
            met = "met" if f.int8_ratio <= nearest.INT8_TARGET else "missed"
            print(f"{met:7s} {f.int8_ratio:.2f} (stretch <= {nearest.INT8_TARGET}) int8 first "
                  f"pass one vector / the {f.dtype} memory floor")  # fmt: skip
    print(f"wrote {path}")
    return 0


def _run_text(args: argparse.Namespace) -> int:
    """``--text``: the text section alone (``bench.text``)."""
    from tokembed.bench import text
    from tokembed.bench.plan import DEPLOYMENT_ENV

    duration_s = args.duration_s if args.duration_s is not None else 8.0
    results = []
    for d_model in (64, 512):
        result = text.measure(args.cache_dir, d_model, duration_s, dict(DEPLOYMENT_ENV))
        print(
            f"D={d_model}: reference {result.reference_tokens_s:,.0f} tokens/s; gRPC "
            f"{result.server_tokens_s:,.0f} tokens/s, ratio {result.ratio:.2f}, p50 "
            f"{result.server_p50_ms:.1f} ms; shared memory {result.shm_tokens_s:,.0f} "
            f"tokens/s, ratio {result.shm_ratio:.2f}, p50 {result.shm_p50_ms:.1f} ms "
            f"(wanted >= {text.TARGET}); {result.errors} errors"
        )
        results.append(result)
    out = args.out if args.out is not None else Path(tempfile.mkdtemp(prefix="tokembed-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    command = "tokembed bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    path = out / f"{args.name or 'text'}.md"
    path.write_text(text.markdown(results, command.strip()), encoding="utf-8")
    print(f"wrote {path}")
    return 1 if any(r.errors for r in results) else 0


def output_dir(out: Path | None, *, quick: bool) -> Path:
    """``--out`` if given; else a full run's record, docs/benchmarks, or for ``--quick`` a
    fresh temporary directory (made now, after the run: a run that fails leaves none)."""
    if out is not None:
        return out
    return Path(tempfile.mkdtemp(prefix="tokembed-bench-")) if quick else FULL_RUN_OUT


def _plan_line(plan: Plan, device: str) -> str:
    return (
        f"plan: D={', '.join(map(str, plan.d_models))}; "
        f"{', '.join(f'{w.name} {w.shape_text}' for w in plan.workloads)}; "
        f"{', '.join(plan.dtypes)}; concurrency {', '.join(map(str, plan.concurrencies))}; "
        f"{plan.duration_s:g} s a cell; device {device}"
        + ("; and the model kinds' cells" if plan.kinds else "")
    )
