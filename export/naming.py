"""The name a model gets when none is given: its output directory's.

``models/llama`` is ``llama``; a directory laid out as a model repository's
``<model>/<version>`` (Triton's layout: the last component all digits), such as
``repo/llama/3``, is named after ``<model>``: ``llama``.
"""

from __future__ import annotations

from pathlib import Path

from tokembed.export.errors import ExportError


def model_name_for(out_dir: Path) -> str:
    # Absolute first: `--out .` is named after the current directory, not "".
    parts = Path(out_dir).absolute().parts
    name = parts[-1] if len(parts) > 1 else ""
    if name.isdigit() and len(parts) > 2:
        name = parts[-2]
    if not name or name in (".", ".."):
        raise ExportError(f"cannot name the model after --out {out_dir}; pass --name")
    return name
