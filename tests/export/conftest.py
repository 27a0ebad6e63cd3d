"""Fixtures of the exporter's tests.

Exports are the slow part (~0.5 s each once torch is warm), so a session-scoped factory
makes each distinct small model once and tests share it read-only; a test that damages a
model directory works on its own copy (``model_copy``). Expected outputs are computed
here from first principles (``torch.randn`` with a seeded generator, numpy float32
arithmetic), never by calling the exporter's own helpers.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch

from tokembed.cli.main import main as cli_main
from tokembed.export.manifest import Manifest
from tokembed.export.modules import TokenEmbedding
from tokembed.export.pipeline import ExportOptions, export_model

SMALL_V = 1000
# D=48: sqrt(48) is irrational, so the scale really rounds (sqrt(64) = 8, a power of
# two, would multiply exactly even in float16 and hide a wrong order of operations).
SMALL_D = 48


def seeded_table(vocab_size: int, d_model: int, seed: int) -> np.ndarray:
    """E as the issue defines it: torch.randn(V, D) from a generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(vocab_size, d_model, generator=generator, dtype=torch.float32).numpy()


def expected_scale(scale: str | float, d_model: int) -> float:
    if scale == "sqrt":
        return math.sqrt(d_model)
    if scale == "none":
        return 1.0
    return float(scale)


def assert_bitwise_equal(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bit for bit (so +0.0 and -0.0 differ, and NaN never passes)."""
    assert got.dtype == np.float32, got.dtype
    assert want.dtype == np.float32, want.dtype
    assert got.shape == want.shape, (got.shape, want.shape)
    if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        raise AssertionError(
            f"{int(np.count_nonzero(got.view(np.uint32) != want.view(np.uint32)))} of "
            f"{got.size} values differ, max abs error {np.nanmax(diff)}"
        )


def open_session(model_dir: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])


@dataclass
class Exported:
    """A model directory exported from a known table, for read-only use."""

    path: Path
    table: np.ndarray  # E, float32 [V, D], as given to the exporter
    scale: float  # the scale the test expects, computed independently
    dtype: str
    padding_idx: int | None
    manifest: Manifest
    _session: ort.InferenceSession | None = field(default=None, repr=False)

    @property
    def vocab_size(self) -> int:
        return int(self.table.shape[0])

    @property
    def d_model(self) -> int:
        return int(self.table.shape[1])

    def run(self, ids: np.ndarray) -> np.ndarray:
        if self._session is None:
            self._session = open_session(self.path)
        out: np.ndarray = self._session.run(["hidden_states"], {"input_ids": ids})[0]
        return out

    def expected(self, ids: np.ndarray) -> np.ndarray:
        """E[id] * scale in float32, the way the issue states it (for float32 storage)."""
        result: np.ndarray = self.table[ids] * np.float32(self.scale)
        return result


@pytest.fixture(scope="session")
def make_export(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Exported]:
    """``make_export(V, D, seed=, scale=, padding_idx=, dtype=, table=)``, cached per arguments.

    With ``table=`` the given matrix is exported (not cached: each call exports).
    """
    cache: dict[tuple[Any, ...], Exported] = {}

    def make(
        vocab_size: int = SMALL_V,
        d_model: int = SMALL_D,
        *,
        seed: int = 0,
        scale: str | float = "sqrt",
        padding_idx: int | None = None,
        dtype: str = "float32",
        table: np.ndarray | None = None,
    ) -> Exported:
        key = (vocab_size, d_model, seed, scale, padding_idx, dtype)
        if table is None and key in cache:
            return cache[key]
        if table is None:
            data = seeded_table(vocab_size, d_model, seed)
            if padding_idx is not None:
                data[padding_idx] = 0.0
        else:
            data = np.ascontiguousarray(table, dtype=np.float32)
            vocab_size, d_model = data.shape
        module = TokenEmbedding(
            vocab_size,
            d_model,
            scale=scale,
            padding_idx=padding_idx,
            # A copy: the module adopts its weight, and the test keeps ``data`` as truth.
            weight=torch.from_numpy(data.copy()),
        )
        out = tmp_path_factory.mktemp("export") / "model"
        manifest = export_model(module, ExportOptions(out_dir=out, weight_dtype=dtype, seed=seed))
        exported = Exported(
            path=out,
            table=data,
            scale=expected_scale(scale, d_model),
            dtype=dtype,
            padding_idx=padding_idx,
            manifest=manifest,
        )
        if table is None:
            cache[key] = exported
        return exported

    return make


@pytest.fixture(scope="session")
def small_export(make_export: Callable[..., Exported]) -> Exported:
    """The default small model: V=1000, D=48, seed 0, scale sqrt(D), float32."""
    return make_export()


@pytest.fixture
def model_copy(small_export: Exported, tmp_path: Path) -> Path:
    """A private copy of the small model directory, for tests that damage it."""
    return Path(shutil.copytree(small_export.path, tmp_path / "model"))


@pytest.fixture(scope="session")
def tokembed_cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run ``tokembed ARGS...`` as users do: a separate process, so a traceback shows."""

    def run(*args: object, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tokembed.cli", *(str(a) for a in args)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    return run


@pytest.fixture
def tokembed_main(
    capsys: pytest.CaptureFixture[str],
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run ``tokembed ARGS...`` through the same ``main()`` in this process: a second less
    per call than a fresh interpreter importing torch. An exception escaping ``main()``
    fails the test, as a traceback would; ``tokembed_cli`` keeps the process-level proof."""

    def run(*args: object) -> subprocess.CompletedProcess[str]:
        argv = [str(a) for a in args]
        capsys.readouterr()  # drop what came before
        try:
            code = cli_main(argv)
        except SystemExit as exc:  # argparse's own exits
            code = exc.code if isinstance(exc.code, int) else 2
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["tokembed", *argv], code, out, err)

    return run


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """A bad input: non-zero exit, no traceback, exactly one line on stderr holding every
    fragment, nothing on stdout. Returns the line."""
    assert proc.returncode != 0, f"exit 0; stdout={proc.stdout!r} stderr={proc.stderr!r}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines!r}"
    line = lines[0]
    assert line.startswith("tokembed export: error: "), line
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    assert proc.stdout == "", proc.stdout
    return line


# The helpers above, as fixtures: test modules here are not a package, so they reach
# shared code through fixtures rather than imports.
@pytest.fixture(scope="session")
def table_of() -> Callable[[int, int, int], np.ndarray]:
    return seeded_table


@pytest.fixture(scope="session")
def bitwise_equal() -> Callable[[np.ndarray, np.ndarray], None]:
    return assert_bitwise_equal


@pytest.fixture(scope="session")
def user_error() -> Callable[..., str]:
    return assert_one_line_error
