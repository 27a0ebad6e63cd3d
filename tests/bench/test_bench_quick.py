"""`tokembed bench --quick` as a smoke test: it runs end to end, says what it measures,
and writes its report where it says, by default a fresh temporary directory.

No thresholds here: CI machines are shared and noisy; the targets are read as ratios in
docs/benchmarks/, from runs made for that purpose.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tokembed.bench.harness import PROGRESS_HEADER
from tokembed.bench.report import ENDPOINTS


@pytest.mark.slow  # ~30 s; `scripts/test --fast` leaves it out
def test_quick_bench_runs_and_writes_its_table(tmp_path: Path) -> None:
    # Run from a directory of its own, with no --out: the report must land in a fresh
    # temporary directory (TMPDIR here, inside tmp_path), never in ./docs/benchmarks.
    (tmp_path / "tmp").mkdir()
    (tmp_path / "cwd").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "tokembed.cli", "bench", "--quick",
         "--cache-dir", str(tmp_path / "models"), "--duration-s", "0.3"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path / "cwd",
        env={**os.environ, "TMPDIR": str(tmp_path / "tmp")},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not any((tmp_path / "cwd").iterdir()), "the quick bench wrote into its directory"
    wrote = re.search(r"^wrote (\S+)/quick\.md in \d+ s$", result.stdout, re.MULTILINE)
    assert wrote is not None, result.stdout[-2000:]
    out = Path(wrote.group(1))
    assert out.parent == tmp_path / "tmp" and out.name.startswith("tokembed-bench-")
    assert [p.name for p in out.iterdir()] == ["quick.md"]
    # It said what it measures before measuring: each endpoint, then the cells' header.
    before_cells = result.stdout.split(PROGRESS_HEADER, 1)[0]
    for name in ENDPOINTS:
        assert re.search(rf"^  {name} ", before_cells, re.MULTILINE), f"no legend for {name}"
    table = (out / "quick.md").read_text()
    for target in ("floor", "floor-deadline", "service-sync", "service-bare", "service-async",
                   "service-chunked", "service-stream", "no-batching", "ceiling"):  # fmt: skip
        assert f"| {target} |" in table, f"no {target} cells"
    assert "## Targets" in table
    assert "## Endpoints" in table
    # Every endpoint's cell has its server's CPU and peak RSS (all but the in-process
    # ceiling, which has no server), whether measured alone or in turns.
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| ")]
    header = next(row for row in rows if "server CPU ms/req" in "|".join(row))
    cpu_at = [c.strip() for c in header].index("server CPU ms/req")
    cells = [row for row in rows if row[1].strip() in ("floor", "service-sync",
             "service-async", "service-chunked", "no-batching")]  # fmt: skip
    assert len(cells) >= 15
    # Every cell's endpoint is one the legend explains.
    all_cells = rows[rows.index(header) + 1 :]
    assert {row[1].strip() for row in all_cells} <= set(ENDPOINTS)
    for row in cells:
        assert row[cpu_at].strip() and row[cpu_at + 1].strip(), f"no server figures: {row}"

    def in_turns(workload: str, concurrency: int) -> set[str]:
        return {row[1].strip() for row in cells if row[4].strip() == "float32"
                and workload in row[2] and row[5].strip() == str(concurrency)
                and "in turns" in row[-2]}  # fmt: skip

    assert in_turns("large", 1) == {"floor", "service-sync", "service-async", "service-chunked"}
    assert in_turns("tiny", 64) == {"floor", "service-sync", "service-async"}
    assert in_turns("tiny", 1) == {"floor", "service-sync"}  # and the two steps between
    # Every target line got a verdict from figures of this run (seven: tiny c=1 and c=64,
    # large unary and chunked, float16 and bfloat16, peak RSS), but the two of the model
    # kinds, whose cells only `--kinds` (or a full run) measures.
    assert table.count("| met |") + table.count("| MISSED |") == 7
    assert table.count("| not measured | not in this run's plan |") == 2
    assert "tiny [1,8], concurrency 1: service p50 / floor p50" in result.stdout
    assert "## Tiny [1,8] at concurrency 1, step by step" in table
    assert "tiny [1,8] c=1 D=512, p50 / floor p50, step by step: floor 1.00" in result.stdout
