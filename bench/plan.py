"""What a bench run measures (the plan) and what it found (its cells)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokembed.bench.runner import Run
from tokembed.bench.workloads import LARGE, MEDIUM, RAGGED, TINY, Workload

MiB = 1 << 20
# The environment the service is measured with: the one its images and Kubernetes manifest
# set (Dockerfile, Dockerfile.cuda, deploy/k8s; tests/deploy checks they all agree), so
# that the bench measures the server as deployed. docs/deployment.md gives the figures.
DEPLOYMENT_ENV = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=4194304"}
# The width at which the targets are judged (see targets.evaluate_targets); the
# tiny c=64 and large cells that they compare are measured in turns at this width
# (bench/cells.py).
TARGETS_D_MODEL = 512


@dataclass(frozen=True)
class Plan:
    d_models: tuple[int, ...]
    workloads: tuple[Workload, ...]
    concurrencies: tuple[int, ...]
    dtypes: tuple[str, ...]
    duration_s: float
    max_requests: int
    # Concurrency cap for answers this many bytes or larger (64 of them in flight measure
    # memory, not transport).
    large_answer_bytes: int = 16 * MiB
    large_max_concurrency: int = 8
    # The model kinds' cells (bench/kinds.py): a factorized model from its table and per
    # batch, at the targets' width.
    kinds: bool = False


QUICK = Plan(
    d_models=(512,), workloads=(TINY, LARGE), concurrencies=(1, 64),
    dtypes=("float32", "float16", "bfloat16"), duration_s=0.6, max_requests=3000,
)  # fmt: skip
FULL = Plan(
    d_models=(512, 4096), workloads=(TINY, MEDIUM, LARGE, RAGGED), concurrencies=(1, 8, 64),
    dtypes=("float32", "float16", "bfloat16"), duration_s=2.0, max_requests=20000, kinds=True,
)  # fmt: skip


@dataclass
class Cell:
    target: str  # floor, service-sync, service-async, service-chunked, ...
    workload: str
    shape: str
    d_model: int
    dtype: str
    concurrency: int
    run: Run
    tokens_per_request: float
    bytes_per_request: float
    server_cpu_s_per_request: float = float("nan")
    server_peak_rss_bytes: int = 0
    notes: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.run.rps * self.tokens_per_request

    @property
    def mb_per_s(self) -> float:
        return self.run.rps * self.bytes_per_request / 1e6


@dataclass
class Results:
    plan: Plan
    cells: list[Cell] = field(default_factory=list)
    weights_bytes: dict[int, int] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)
    # The V2 section (bench/v2.py): its cells, and what it skipped and why.
    v2_cells: list[Cell] = field(default_factory=list)
    v2_notes: list[str] = field(default_factory=list)

    def find(
        self,
        target: str,
        workload: str,
        d_model: int,
        dtype: str,
        concurrency: int,
        *,
        v2: bool = False,
    ) -> Cell | None:
        """The cell of the main section (or with ``v2``, of the V2 section) with these."""
        for cell in self.v2_cells if v2 else self.cells:
            if (cell.target, cell.workload, cell.d_model, cell.dtype, cell.concurrency) == (
                target, workload, d_model, dtype, concurrency,
            ):  # fmt: skip
                return cell
        return None
