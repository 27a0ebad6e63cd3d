"""The subcommands that need an extra, run where it is missing: each says which extra to
install, in one line (cli/main.py's ``_EXTRAS``). Shared by the test that hides the
packages (tests/test_missing_extras.py) and the one that installs tokembed alone
(tests/e2e/test_install_beside_tritonclient.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

# command -> (its arguments; "{model}" a model directory, "{tmp}" a scratch directory),
# the module a base install misses first, what the line tells to install.
CASES = {
    "serve": (
        ["serve", "--model-dir", "{model}", "--port", "0", "--metrics-port", "0"],
        "grpc_health",
        "pip install 'tokembed[server]'",
    ),
    "export-triton": (["export-triton", "{model}", "{tmp}/repo"], "onnx", "'tokembed[server]'"),
    "bench": (
        ["bench", "--quick", "--out", "{tmp}/bench", "--cache-dir", "{tmp}/bench-models"],
        "onnxruntime",
        "tokembed[server,export,bench]",
    ),
    "export": (
        ["export", "--out", "{tmp}/exported"],
        "torch",
        "tokembed[export] (see the README); --builtin needs only tokembed[server]",
    ),
}


def arguments(command: str, model: Path, tmp: Path) -> list[str]:
    return [a.format(model=model, tmp=tmp) for a in CASES[command][0]]


def assert_names_the_extra(proc: subprocess.CompletedProcess[str], command: str) -> None:
    """Exit status 2, one line on stderr naming the missing module and the extra, nothing
    else (no traceback)."""
    _, module, install = CASES[command]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    line = proc.stderr.strip()
    assert line.startswith(f"tokembed {command}: error: tokembed {command} needs {module}, "), line
    assert install in line, line
