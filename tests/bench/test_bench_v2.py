"""The bench's V2 section: its targets read its own cells, and `tokembed bench --v2` runs end
to end (without MLServer, whose first run installs it from PyPI into an environment of its
own: minutes, and a network CI need not have).

No thresholds on measured figures here, as for the quick bench: the targets are judged in
docs/benchmarks from runs made for that purpose.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tokembed.bench.plan import QUICK, Cell, Results
from tokembed.bench.report import V2_ENDPOINTS, markdown
from tokembed.bench.runner import Run
from tokembed.bench.targets import evaluate_v2_targets


def cell(target: str, workload: str, concurrency: int, rps: float, p50_ms: float) -> Cell:
    requests = int(rps * 2)
    run = Run(requests=requests, errors=0, wall_s=2.0,
              latencies_s=np.full(requests, p50_ms / 1000))  # fmt: skip
    rows = {"tiny": 8, "medium": 1024, "large": 16384}[workload]
    return Cell(
        target=target, workload=workload, shape="", d_model=512, dtype="float32",
        concurrency=concurrency, run=run, tokens_per_request=float(rows),
        bytes_per_request=rows * 512 * 4.0,
    )  # fmt: skip


def test_the_v2_targets_read_the_v2_cells_only() -> None:
    v2_cells = [
        cell("v2", "tiny", 1, 1000, 1.0), cell("v1", "tiny", 1, 1100, 0.9),
        cell("mlserver", "tiny", 1, 200, 5.0),
        cell("v2", "tiny", 32, 2000, 16), cell("mlserver", "tiny", 32, 500, 64),
        cell("v2", "medium", 1, 100, 10), cell("mlserver", "medium", 1, 5, 200),
        cell("v2", "medium", 8, 100, 80), cell("mlserver", "medium", 8, 20, 400),
        cell("v2-shm", "large", 1, 20, 50), cell("floor", "large", 1, 4, 250),
        cell("ceiling", "large", 1, 30, 33),
    ]  # fmt: skip
    # The main section's floor and ceiling for the same shape are other figures: unused.
    main_cells = [cell("floor", "large", 1, 1, 1000), cell("ceiling", "large", 1, 1, 1000)]
    results = Results(plan=QUICK, cells=main_cells, v2_cells=v2_cells)
    measured = {t.name.split(": ", 1)[1]: t.measured for t in evaluate_v2_targets(results)}
    assert measured == {
        "tiny [1,8] c=1: tokembed V2 req/s / MLServer req/s": 5.0,
        "tiny [1,8] c=32: tokembed V2 req/s / MLServer req/s": 4.0,
        "[8,128] c=1: tokembed V2 MB/s / MLServer MB/s": 20.0,
        "[8,128] c=8: tokembed V2 MB/s / MLServer MB/s": 5.0,
        "tiny [1,8] c=1: tokembed V2 p50 / tokembed v1 p50": pytest.approx(1.0 / 0.9),
        "large [32,512] float32 c=1: shared memory MB/s / gRPC floor unary MB/s": (
            pytest.approx(5.0)
        ),
        "large [32,512] float32 c=1: shared memory MB/s / in-process look-up MB/s": (
            pytest.approx(20 / 30)
        ),
    }
    verdicts = [t.verdict for t in evaluate_v2_targets(results)]
    assert verdicts == ["met", "met", "met", "MISSED", "met", "met", "met"]


def test_a_skipped_mlserver_leaves_its_targets_unmeasured_and_says_why() -> None:
    results = Results(
        plan=QUICK,
        v2_cells=[cell("v2", "tiny", 1, 1000, 1.0), cell("v1", "tiny", 1, 1000, 1.0)],
        v2_notes=["MLServer skipped: --no-mlserver"],
    )
    verdicts = {t.name: t.verdict for t in evaluate_v2_targets(results)}
    assert [name for name, v in verdicts.items() if v != "not measured"] == [
        "V2: tiny [1,8] c=1: tokembed V2 p50 / tokembed v1 p50"
    ]
    table = markdown(results, [], "tokembed bench --v2")
    assert "## V2 (the Open Inference Protocol)" in table
    assert "- MLServer skipped: --no-mlserver" in table
    for name in V2_ENDPOINTS:
        assert f"| `{name}` |" in table


def test_docs_benchmarks_readme_has_a_row_for_each_v2_endpoint() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "README.md").read_text()
    section = text.split("## The V2 section", 1)[1]
    rows = set(re.findall(r"^\| `([a-z0-9-]+)` \|", section, re.MULTILINE))
    assert set(V2_ENDPOINTS) <= rows, f"no row for {set(V2_ENDPOINTS) - rows}"


@pytest.mark.slow  # ~1 min (an export of the bench model, a server, the floor, 5 groups)
def test_the_v2_section_runs_and_writes_its_table(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "tokembed.cli", "bench", "--v2", "--no-mlserver",
         "--cache-dir", str(tmp_path / "models"), "--duration-s", "0.2", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(rf"^wrote {re.escape(str(out))}/v2\.md in \d+ s$", result.stdout, re.M)
    assert [p.name for p in out.iterdir()] == ["v2.md"]
    table = (out / "v2.md").read_text()
    assert "- MLServer skipped: --no-mlserver" in table
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| ")]
    cells = {(row[1].strip(), row[2].strip().split()[0], row[5].strip()) for row in rows
             if row[1].strip() in V2_ENDPOINTS}  # fmt: skip
    assert cells == {
        ("v2", "tiny", "1"), ("v1", "tiny", "1"), ("v2", "tiny", "32"), ("v1", "tiny", "32"),
        ("v2", "medium", "1"), ("v1", "medium", "1"), ("v2", "medium", "8"),
        ("v1", "medium", "8"), ("v2-shm", "large", "1"), ("v2", "large", "1"),
        ("v1", "large", "1"), ("floor", "large", "1"), ("ceiling", "large", "1"),
    }  # fmt: skip
    # Every call answered: the errors column is 0 in every V2 row.
    header = next(row for row in rows if "errors" in [c.strip() for c in row])
    errors_at = [c.strip() for c in header].index("errors")
    assert all(row[errors_at].strip() == "0" for row in rows if row[1].strip() in V2_ENDPOINTS)
    # The section's targets are printed, those needing MLServer unmeasured.
    assert "not measured" in result.stdout and "shared memory MB/s / gRPC floor" in result.stdout
