"""The built-in default model (V=32000, D=512, seed 0), created on first start.

Built in this process by ``tokembed.export.builtin`` from numpy, onnx and onnxruntime, which
the server installs anyway: serving the default model needs no torch. Container images bake
a model in instead, so they never take this path.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tokembed.export.builtin import DEFAULT, build_builtin_model
from tokembed.export.errors import ExportError
from tokembed.export.manifest import MANIFEST_NAME
from tokembed.server.core.errors import ServerConfigError

logger = logging.getLogger(__name__)


def ensure_default_model(directory: Path) -> Path:
    """``directory``, holding the default model (built there first if it has no manifest).

    The loader checks it afterwards like any model directory; a directory that already has
    a manifest is left as it is.
    """
    if (directory / MANIFEST_NAME).is_file():
        return directory
    logger.info(
        "no model in %s yet: building the built-in default model %s there (V=%d D=%d seed %d)",
        directory, DEFAULT.name, DEFAULT.vocab_size, DEFAULT.d_model, DEFAULT.seed,
    )  # fmt: skip
    try:
        build_builtin_model(directory)
    except ExportError as exc:
        raise ServerConfigError(
            f"cannot create the default model: {exc} (--default-model-dir builds it "
            "elsewhere, --model-dir serves another model)"
        ) from exc
    except OSError as exc:
        reason = exc.strerror or exc
        where = exc.filename or directory
        raise ServerConfigError(
            f"cannot create the default model in {directory}: {reason}: {where}"
        ) from exc
    return directory
