"""What the table cache costs and saves at load: one model's load without the cache, the
first load with it (the tables computed, then written and synced), and a load that maps
them (a worker started after the first, a server started again).

    python -m tokembed.bench.table_cache_load [--vocab-size V] [--d-model D] [--runs 3]

Builds the built-in model at that shape (no torch) in a temporary directory, every table
kept (the table budgets raised to its tables), and loads it in this process, each way in
turn, ``--runs`` times; prints each load's seconds and its ratio to the load without the
cache of the same turn. A load includes checking the model's files against their sha256.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    from tokembed.export.builtin import BuiltinSpec, build_builtin_model
    from tokembed.server.models.loading import load_model
    from tokembed.server.process.settings import Settings

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tokembed-table-cache-load-"))
    try:
        model = root / "model"
        build_builtin_model(model, BuiltinSpec(args.vocab_size, args.d_model))
        kept = args.vocab_size * args.d_model * 4
        budgets = {f"{dtype}_table_max_bytes": kept for dtype in ("float32", "float16", "bfloat16")}
        for turn in range(args.runs):
            cache = root / f"cache-{turn}"  # empty: its first load computes
            ways = (
                ("without the cache", Settings(table_cache_max_bytes=0, **budgets)),
                ("first with it (computed, written)", Settings(table_cache_dir=cache, **budgets)),
                ("mapped from it", Settings(table_cache_dir=cache, **budgets)),
            )
            seconds = []
            for _, settings in ways:
                started = time.perf_counter()
                loaded = load_model(model, settings)
                seconds.append(time.perf_counter() - started)
                del loaded
                gc.collect()  # the tables go: the next load computes or maps its own
            print(
                f"turn {turn + 1}: "
                + "; ".join(
                    f"{way} {s:.2f} s ({s / seconds[0]:.2f})"
                    for (way, _), s in zip(ways, seconds, strict=True)
                )
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
