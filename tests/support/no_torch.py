"""A child process in which torch cannot be imported, as in an install of tokembed[server]."""

from __future__ import annotations

import os
from pathlib import Path

_STAND_IN = (
    "# Shadows the real torch for the test's child process.\n"
    "raise ModuleNotFoundError(\"No module named 'torch' (hidden by the test)\", name='torch')\n"
)


def env_without_torch(directory: Path) -> dict[str, str]:
    """``os.environ`` plus a PYTHONPATH whose first entry holds a stand-in ``torch`` package
    that fails to import; it reaches the child's own children (and restarts) too."""
    package = directory / "torch"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(_STAND_IN)
    path = [str(directory), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
