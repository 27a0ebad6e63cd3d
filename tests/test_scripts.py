"""scripts/test's own arguments: ``--help`` answers at once, everything else goes to pytest.

The script runs for real, in bash, on a PATH whose ``python``, ``python3``, ``ruff``,
``mypy`` and ``pip`` only write down that they ran and with what. Stand-ins, not the
real tools, because the point is to see which of them the script calls (and set-up,
lint and pytest for real take minutes); everything else on PATH is the machine's own.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "test"
RECORDED = ("python", "python3", "ruff", "mypy", "pip")


def _sandbox(tmp_path: Path, **extra: str) -> tuple[dict[str, str], Path]:
    """The environment to run the script in, and the file the stand-ins write to (one
    line per call: the name, then each argument in brackets)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    for name in RECORDED:
        stand_in = bin_dir / name
        stand_in.write_text(
            "#!/bin/sh\n"
            f"{{ printf '%s' {name}; for a in \"$@\"; do printf ' [%s]' \"$a\"; done; "
            f"printf '\\n'; }} >>'{log}'\n"
        )
        stand_in.chmod(0o755)
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("VIRTUAL_ENV", "TOKEMBED_NO_SETUP", "TOKEMBED_VENV", "PYTHON")
    }
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    # Where a set-up would create its environment: it must stay absent.
    env["TOKEMBED_VENV"] = str(tmp_path / "venv")
    env.update(extra)
    return env, log


@pytest.mark.parametrize(
    "args", [["--help"], ["-h"], ["--fast", "--help"], ["tests/export", "-x", "-h"]]
)
def test_help_prints_the_usage_and_runs_nothing(tmp_path: Path, args: list[str]) -> None:
    env, log = _sandbox(tmp_path)
    result = subprocess.run(
        [str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: scripts/test [--fast] [PYTEST_ARGS...]\n")
    assert "--fast        all but the tests marked slow" in result.stdout
    assert '-m "not slow" -n 2 --dist loadfile' in result.stdout
    assert "PYTEST_ARGS   every other argument goes to pytest" in result.stdout
    # No set-up line, no environment made, no tool called.
    assert result.stderr == ""
    assert not (tmp_path / "venv").exists()
    assert not log.exists(), log.read_text()


def test_other_arguments_go_to_pytest_after_the_lint(tmp_path: Path) -> None:
    """``--fast`` becomes its pytest options; a pytest option such as ``--co`` (or a
    value such as ``-k help``) passes through as it is."""
    env, log = _sandbox(tmp_path, TOKEMBED_NO_SETUP="1")
    result = subprocess.run(
        [str(SCRIPT), "--fast", "--co", "-q", "-k", "help"],
        env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "usage:" not in result.stdout
    calls = log.read_text().splitlines()
    assert calls[:2] == ["ruff [check] [.]", "ruff [format] [--check] [.]"]
    assert calls[2].startswith("mypy [-p] [tokembed.export]")
    assert calls[3:] == [
        "python [-m] [pytest] [-m] [not slow] [-n] [2] [--dist] [loadfile] [--co] [-q] [-k] [help]"
    ]
