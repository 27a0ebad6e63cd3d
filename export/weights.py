"""Loading the embedding matrix from a checkpoint, by key, never executing pickled code."""

from __future__ import annotations

import zipfile
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
    shapes, tensor = _read(path, key)
    if tensor is None:
        matrices = sorted(name for name, shape in shapes.items() if len(shape) == 2)
        raise CheckpointError(
            f"key {key!r} not found in {path.name}; keys holding 2-D matrices: "
            + (", ".join(matrices) if matrices else "(none)")
        )
    if tensor.dim() != 2:
        raise CheckpointError(
            f"{key!r} in {path.name} has shape {list(tensor.shape)}, expected a 2-D [V, D] matrix"
        )
    if not tensor.is_floating_point():
        raise CheckpointError(f"{key!r} in {path.name} is {tensor.dtype}, expected a float matrix")
    # A tied checkpoint holds this tensor under several keys, sharing one storage:
    # copy it out so nothing else in the file stays alive through it.
    return tensor.detach().to(torch.float32).clone()


def _read(path: Path, key: str) -> tuple[dict[str, list[int]], torch.Tensor | None]:
    """The shape of every tensor in the file, and the tensor at ``key`` (None if absent)."""
    suffix = path.suffix.lower()
    if suffix not in (*_TORCH_SUFFIXES, _SAFETENSORS_SUFFIX):
        raise CheckpointError(
            f"{path.name}: unknown checkpoint type {suffix!r}; "
            f"expected one of {[*_TORCH_SUFFIXES, _SAFETENSORS_SUFFIX]}"
        )
    progress = Progress(f"loading {path.name}", path.stat().st_size)
    progress.update(0)
    try:
        if suffix == _SAFETENSORS_SUFFIX:
            # safe_open reads the header, then only the one tensor asked for:
            # safetensors.torch.load_file would read the whole checkpoint (the full
            # model, often many times the embedding table) into memory.
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                names = handle.keys()  # a safe_open handle is not iterable
                shapes = {name: list(handle.get_slice(name).get_shape()) for name in names}
                tensor = handle.get_tensor(key) if key in shapes else None
        else:
            # weights_only: a checkpoint is data; never run the pickled code it may carry.
            # mmap: only the pages of the chosen tensor are read. torch can mmap only its
            # zip format (torch >= 1.6); older checkpoints (many early Hugging Face
            # .bin files) are read whole rather than refused.
            loaded = torch.load(
                str(path),
                map_location="cpu",
                weights_only=True,
                mmap=zipfile.is_zipfile(path),
            )
            tensors = _flatten(loaded, path)
            shapes = {name: list(t.shape) for name, t in tensors.items()}
            tensor = tensors.get(key)
    except CheckpointError:
        raise
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot read checkpoint {path.name}: {first_line}") from exc
    progress.update(path.stat().st_size)
    progress.close()
    return shapes, tensor


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
