"""A child process in which torch (or another package) cannot be imported, as in an install
of tokembed[server] (or of tokembed alone)."""

from __future__ import annotations

import os
from pathlib import Path

_STAND_IN = (
    "# Shadows the real {name} for the test's child process.\n"
    "raise ModuleNotFoundError(\"No module named '{name}' (hidden by the test)\", name='{name}')\n"
)


def env_without_torch(directory: Path) -> dict[str, str]:
    """``os.environ`` plus a PYTHONPATH whose first entry holds a stand-in ``torch`` package
    that fails to import; it reaches the child's own children (and restarts) too."""
    return env_without(directory, "torch")


def env_without(directory: Path, *names: str) -> dict[str, str]:
    """``os.environ`` plus a PYTHONPATH whose first entry holds, for each top-level module
    name, a stand-in package that fails to import as a missing one does."""
    for name in names:
        package = directory / name
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text(_STAND_IN.format(name=name))
    path = [str(directory), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
