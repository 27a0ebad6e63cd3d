"""Loading the embedding matrix from a checkpoint, by key, never executing pickled code."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from tokembed.export.errors import CheckpointError
from tokembed.export.hashing import Progress

_TORCH_SUFFIXES = (".pt", ".pth", ".bin")
_SAFETENSORS_SUFFIX = ".safetensors"


def load_matrix(path: Path, key: str) -> torch.Tensor:
    """The 2-D float tensor stored under ``key`` in a state_dict or safetensors file."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    tensors = _read_tensors(path)
    if key not in tensors:
        matrices = sorted(name for name, t in tensors.items() if t.dim() == 2)
        raise CheckpointError(
            f"key {key!r} not found in {path.name}; keys holding 2-D matrices: "
            + (", ".join(matrices) if matrices else "(none)")
        )
    tensor = tensors[key]
    if tensor.dim() != 2:
        raise CheckpointError(
            f"{key!r} in {path.name} has shape {list(tensor.shape)}, expected a 2-D [V, D] matrix"
        )
    if not tensor.is_floating_point():
        raise CheckpointError(f"{key!r} in {path.name} is {tensor.dtype}, expected a float matrix")
    # A tied checkpoint holds this tensor under several keys, sharing one storage:
    # copy it out so nothing else in the file stays alive through it.
    return tensor.detach().to(torch.float32).clone()


def _read_tensors(path: Path) -> Mapping[str, torch.Tensor]:
    suffix = path.suffix.lower()
    progress = Progress(f"loading {path.name}", path.stat().st_size)
    progress.update(0)
    try:
        if suffix == _SAFETENSORS_SUFFIX:
            from safetensors.torch import load_file

            loaded: object = load_file(str(path))
        elif suffix in _TORCH_SUFFIXES:
            # weights_only: a checkpoint is data; never run the pickled code it may carry.
            loaded = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        else:
            raise CheckpointError(
                f"{path.name}: unknown checkpoint type {suffix!r}; "
                f"expected one of {[*_TORCH_SUFFIXES, _SAFETENSORS_SUFFIX]}"
            )
    except CheckpointError:
        raise
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot read checkpoint {path.name}: {first_line}") from exc
    progress.update(path.stat().st_size)
    progress.close()
    return _flatten(loaded, path)


def _flatten(loaded: object, path: Path) -> dict[str, torch.Tensor]:
    """A state_dict, possibly nested (``{"model": {...}}``), as dotted keys to tensors."""
    if isinstance(loaded, torch.Tensor):
        raise CheckpointError(f"{path.name} holds a bare tensor, not a state_dict with keys")
    if not isinstance(loaded, Mapping):
        raise CheckpointError(f"{path.name} holds a {type(loaded).__name__}, not a state_dict")
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, node: Mapping[object, object]) -> None:
        for name, value in node.items():
            full = f"{prefix}{name}"
            if isinstance(value, torch.Tensor):
                flat[full] = value
            elif isinstance(value, Mapping):
                walk(f"{full}.", value)

    walk("", loaded)
    return flat
