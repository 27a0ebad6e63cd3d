"""The built-in default model (V=32000, D=512, seed 0), created on first start.

The server never imports torch: when the default model directory has no manifest yet,
it runs ``tokembed export`` in a child process, which needs ``tokembed[export]``.
Container images bake a model in instead, so they never take this path.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from tokembed.export.manifest import MANIFEST_NAME
from tokembed.server.core.errors import ServerConfigError

logger = logging.getLogger(__name__)

DEFAULT_EXPORT_ARGS = ("--vocab-size", "32000", "--d-model", "512", "--seed", "0",
                       "--name", "tokembed-default")  # fmt: skip


def ensure_default_model(directory: Path) -> Path:
    if (directory / MANIFEST_NAME).is_file():
        return directory
    logger.info("no model in %s yet: exporting the built-in default model there", directory)
    command = [sys.executable, "-m", "tokembed.cli", "export", "--out", str(directory),
               *DEFAULT_EXPORT_ARGS]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        detail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        hint = ""
        if "torch" in result.stderr and "No module named" in result.stderr:
            hint = " (install tokembed[export] and a CPU torch, or pass --model-dir)"
        raise ServerConfigError(f"cannot create the default model in {directory}: {detail}{hint}")
    logger.info("%s", result.stdout.strip())
    return directory
