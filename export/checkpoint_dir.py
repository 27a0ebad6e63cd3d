"""``--weights DIR``: the checkpoint in a model directory as transformers saves it.

transformers looks for these names, safetensors first; so does ``checkpoint_in``. A
directory holding none of them, or both forms of one (a file and a sharded index), is
refused in one line that says what to give instead.
"""

from __future__ import annotations

from pathlib import Path

from tokembed.export.errors import CheckpointError

# (single file, sharded index), in transformers' order of preference.
_FORMS = (
    ("model.safetensors", "model.safetensors.index.json"),
    ("pytorch_model.bin", "pytorch_model.bin.index.json"),
)
_CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def checkpoint_in(path: Path) -> Path:
    """``path`` itself unless it is a directory; then the checkpoint in it."""
    if not path.is_dir():
        return path
    for names in _FORMS:
        present = [path / name for name in names if (path / name).is_file()]
        if len(present) > 1:
            raise CheckpointError(
                f"{path} holds both {present[0].name} and {present[1].name}: give --weights "
                "the one to read"
            )
        if present:
            return present[0]
    others = sorted(p.name for p in path.iterdir() if p.is_file() and p.name.endswith(
        _CHECKPOINT_SUFFIXES))  # fmt: skip
    expected = ", ".join(name for names in _FORMS for name in names)
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise CheckpointError(
            f"{path} is a directory with no {expected}; give --weights one of its files: {shown}"
        )
    raise CheckpointError(
        f"{path} is a directory with no checkpoint in it ({expected}); give --weights the "
        "checkpoint file"
    )
