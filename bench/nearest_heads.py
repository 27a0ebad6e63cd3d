"""The head's two multiplies on the CPU, in process: numpy and the head graph in
onnxruntime (``--nearest-head``), each ``NearestHead.search`` timed alone, without the
serving around it, and what the graph's session holds beside the table.

    python -m tokembed.bench.nearest_heads MODEL_DIR [--turns 5]

``MODEL_DIR``: a model with a head (``tokembed bench --nearest`` writes its synthetic ones
into its cache). Cases: one vector, and 16 queries of 8 vectors in one batch (the 16
callers' batch), ``k = 1``, ``dot``; the fastest of ``--turns`` turns, the two heads
alternating. Prints each time and onnxruntime's over numpy's.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

CALLERS, VECTORS_EACH = 16, 8


def _resident_mib() -> float:
    """This process's resident memory (Linux's /proc)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20


def main(argv: list[str] | None = None) -> int:
    from tokembed.export.head import head_table
    from tokembed.export.manifest import Manifest
    from tokembed.server.backends.head import NearestHead, Query
    from tokembed.server.backends.head_session import HeadGraph, HeadSession
    from tokembed.server.backends.sessions import SessionOptions

    parser = argparse.ArgumentParser(prog="python -m tokembed.bench.nearest_heads")
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args(argv)
    manifest = Manifest.read(args.model_dir)
    if manifest.head is None:
        parser.error(f"{args.model_dir} has no head")
    table = np.ascontiguousarray(head_table(args.model_dir, manifest))
    before = _resident_mib()
    session = HeadSession(HeadGraph(args.model_dir / manifest.head.graph), table, SessionOptions())
    held_mib = _resident_mib() - before
    heads = {
        "numpy": NearestHead(table, None, manifest.head.table, shared=False),
        "onnxruntime": NearestHead(table, None, manifest.head.table, shared=False, graph=session),
    }
    rows = np.random.default_rng(0).standard_normal((CALLERS * VECTORS_EACH, manifest.d_model))
    rows = rows.astype(np.float32)
    cases = {
        "one vector": [Query(rows[:1], 1, "dot", False, False)],
        f"{CALLERS} x {VECTORS_EACH} in one batch": [
            Query(rows[i * VECTORS_EACH : (i + 1) * VECTORS_EACH], 1, "dot", False, False)
            for i in range(CALLERS)
        ],
    }
    for head in heads.values():  # the first call of each pays its set-up
        head.search(cases["one vector"])
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.turns):
        for case, queries in cases.items():
            for name, head in heads.items():
                started = time.perf_counter()
                head.search(queries)
                elapsed = time.perf_counter() - started
                best[name, case] = min(best.get((name, case), elapsed), elapsed)
    dtype = manifest.head.weight_dtype
    print(f"{args.model_dir.name}: table {table.nbytes / 2**20:.0f} MiB ({dtype}); the "
          f"graph's session holds {held_mib:.0f} MiB more")  # fmt: skip
    for case in cases:
        numpy_s, graph_s = best["numpy", case], best["onnxruntime", case]
        print(f"{case}: numpy {numpy_s * 1e3:.1f} ms, onnxruntime {graph_s * 1e3:.1f} ms, "
              f"onnxruntime / numpy {graph_s / numpy_s:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
