"""A subcommand run without the extra that brings its packages says which extra to install:
one line, exit status 2, no traceback. A real ``tokembed`` process, its packages hidden by
stand-ins that fail to import as a missing package does (tests/support/no_torch.py);
tests/e2e/test_install_beside_tritonclient.py runs the same commands in a real install of
tokembed alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tokembed.cli.main import missing_extra

from support.extras import CASES, arguments, assert_names_the_extra
from support.no_torch import env_without


@pytest.mark.parametrize("command", CASES)
def test_command_names_the_extra_it_needs(
    command: str, tmp_path: Path, small_model_dir: Path
) -> None:
    module = CASES[command][1]
    proc = subprocess.run(
        [sys.executable, "-m", "tokembed.cli", *arguments(command, small_model_dir, tmp_path)],
        capture_output=True, text=True, timeout=240,
        env=env_without(tmp_path / "hidden", module), cwd=tmp_path,
    )  # fmt: skip
    assert_names_the_extra(proc, command)


@pytest.mark.parametrize(
    ("command", "missing"),
    [
        ("serve", "numpy"),  # the base install's: a broken install, not a missing extra
        ("serve", "torch"),  # [export]'s, which serve never imports: a bug
        ("embed", "onnxruntime"),  # the client needs no extra
        ("serve", "tokembed.server.app"),  # tokembed's own module: a broken install
    ],
)
def test_other_missing_modules_keep_their_traceback(command: str, missing: str) -> None:
    assert missing_extra(command, ModuleNotFoundError(name=missing)) is None


def test_a_submodule_counts_as_its_package() -> None:
    line = missing_extra("serve", ModuleNotFoundError(name="grpc_health.v1"))
    assert line is not None and "needs grpc_health," in line
