"""What ``tokembed bench`` tells and where it writes, without running a plan: the legend
(every endpoint named, each with a row in docs/benchmarks/README.md), the default output
directory, --help, and the ceiling, which must compute the service's own answers."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tokembed.bench.ceiling import Ceiling, ceiling_ids, load_backend
from tokembed.bench.cli import FULL_RUN_OUT, output_dir
from tokembed.bench.report import ENDPOINTS, legend
from tokembed.client import EmbeddingClient

from support.server import ServerThread

ROOT = Path(__file__).resolve().parents[2]
# Every endpoint bench/cells.py and bench/kinds.py measure (the slow smoke test,
# test_bench_quick.py, checks that a real run's cells are all in ENDPOINTS).
MEASURED = (
    "floor", "floor-deadline", "service-bare", "service-sync", "service-async",
    "service-chunked", "service-stream", "no-batching", "ceiling",
    "token-table", "factorized-table", "factorized-batched", "factorized-unbatched",
)  # fmt: skip


def test_the_legend_names_every_endpoint() -> None:
    assert tuple(ENDPOINTS) == MEASURED
    lines = legend(columns=80)
    starts = [line.split()[0] for line in lines if not line.startswith(" ")]
    assert starts == list(MEASURED)
    assert all(len(line) <= 80 for line in lines), lines


def test_docs_benchmarks_readme_has_a_row_for_each_endpoint() -> None:
    text = (ROOT / "docs" / "benchmarks" / "README.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `([a-z-]+)` \|", text, re.MULTILINE))
    assert set(MEASURED) <= rows, f"no row for {set(MEASURED) - rows}"


def test_quick_writes_to_a_fresh_temporary_directory_a_full_run_to_docs_benchmarks() -> None:
    first, second = output_dir(None, quick=True), output_dir(None, quick=True)
    try:
        assert first != second
        for made in (first, second):
            assert made.is_dir() and not any(made.iterdir())
            assert made.parent == Path(tempfile.gettempdir())
    finally:
        first.rmdir()
        second.rmdir()
    assert output_dir(None, quick=False) == FULL_RUN_OUT == Path("docs/benchmarks")
    assert output_dir(Path("mine"), quick=True) == Path("mine")
    assert output_dir(Path("mine"), quick=False) == Path("mine")


def test_help_says_where_it_writes_and_how_long_quick_takes() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tokembed.cli", "bench", "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "Default: docs/benchmarks for a full run" in text
    assert "a fresh temporary directory for --quick. Printed at the end" in text
    assert "about a minute on 2 cores" in text


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_ceiling_computes_the_services_answers(
    dtype: str, start_server: Callable[..., ServerThread], small_model_dir: Path
) -> None:
    """The ceiling is the service's look-up: for the same ids, the bytes the server sends,
    rectangular and ragged (padding rows included)."""
    server = start_server(small_model_dir)
    ceiling = Ceiling(load_backend(small_model_dir, "cpu"), dtype)
    rng = np.random.default_rng(7)
    rectangular = rng.integers(0, 1000, size=(4, 300), dtype=np.int64)  # past the gather size
    ragged = [[5, 6, 7], [999], [0, 1, 2, 3, 4, 5]]
    with EmbeddingClient(server.target) as client:
        for ids in (rectangular, ragged, [[1, 2, 3]]):
            answer = client.embed(ids, dtype)
            assert bytes(ceiling(ceiling_ids(ids))) == np.ascontiguousarray(answer).tobytes()
