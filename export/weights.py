"""Reading a matrix from a checkpoint, by key, never executing pickled code.

A checkpoint is a torch state_dict (``.pt``, ``.pth``, ``.bin``), a ``.safetensors`` file,
or the index of a sharded one (``*.safetensors.index.json``, ``pytorch_model.bin.index.json``),
whose ``weight_map`` names the shard that holds each key: only that shard is opened.

``open_matrix`` gives a ``CheckpointMatrix``: the matrix's shape and dtype, and its rows a
slice at a time, so that neither the checkpoint nor the matrix is ever held in memory
whole (a safetensors tensor is read from its offset in the file, with plain reads, never
mapped; a torch zip file is memory-mapped). ``load_matrix`` reads a matrix whole, as
float32, and ``load_vector`` a vector (a projection's bias). ``find_tie`` says whether the
matrix is also the model's output projection.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

import torch

from tokembed.export.architecture import CONFIG_NAME
from tokembed.export.checkpoint_files import (
    INDEX_SUFFIX,
    CheckpointMatrix,
    KeyMissing,
    missing_key,
    open_file_matrix,
    tensor_shapes,
    torch_tensors,
)
from tokembed.export.errors import CheckpointError
from tokembed.export.hashing import phase
from tokembed.export.manifest import Tie

# Rows are compared (ties) this many bytes at a time.
_COMPARE_BYTES = 32 * 1024 * 1024


def open_matrix(path: Path, key: str) -> CheckpointMatrix:
    """The 2-D float matrix at ``key`` in the checkpoint (or sharded checkpoint) ``path``."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.name.endswith(INDEX_SUFFIX):
        return open_file_matrix(_shard_of(path, key), key, index=path)
    return open_file_matrix(path, key)


def load_matrix(path: Path, key: str) -> torch.Tensor:
    """The 2-D float tensor stored under ``key`` in a state_dict, a safetensors file or a
    sharded checkpoint's index, read whole and widened to float32, a copy of its own."""
    with open_matrix(path, key) as matrix, phase(f"loading {key} from {matrix.file.name}"):
        rows = matrix.rows(0, matrix.shape[0])
    # rows is a fresh tensor already; widening makes another only when the dtype differs.
    return rows.to(torch.float32)


def load_vector(path: Path, key: str) -> torch.Tensor:
    """The 1-D float tensor at ``key`` (a projection's bias) in a state_dict or a
    safetensors file, as float32: safetensors reads its one tensor, torch files are read
    as ``open_matrix`` reads them."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    tensor: torch.Tensor | None
    if path.suffix.lower() == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as handle:
                names = set(handle.keys())  # a safe_open handle is not iterable
                tensor = handle.get_tensor(key) if key in names else None
        except Exception as exc:
            raise CheckpointError(f"cannot read {key!r} from {path.name}: {exc}") from exc
    else:
        tensor = torch_tensors(path).get(key)
    if tensor is None:
        raise CheckpointError(f"key {key!r} not found in {path.name}")
    if tensor.dim() != 1 or not tensor.is_floating_point():
        raise CheckpointError(
            f"{key!r} in {path.name} is {tensor.dtype}{list(tensor.shape)}, expected a 1-D "
            "float vector"
        )
    return tensor.detach().to(torch.float32).clone()


def find_tie(matrix: CheckpointMatrix, checkpoint: Path, projection: str) -> Tie:
    """Whether ``projection`` (the key of the model's output projection) is this same matrix.

    The evidence, in this order: ``projection`` is the exported key itself; it names the
    same storage in a torch file; it holds equal values (same dtype and shape, bit for
    bit, compared a slice at a time); it is absent and the ``config.json`` beside the
    checkpoint declares ``tie_word_embeddings`` for a vocabulary and width that are this
    matrix's (transformers saves a tied matrix once, under one name, and re-ties it on
    load). Present with other values: untied. Absent without that declaration: an error.
    """
    keys = [matrix.key, *matrix.aliases]
    if projection == matrix.key:
        return Tie(projection, True, "the exported key itself", keys)
    if projection in matrix.aliases:
        return Tie(projection, True, "shared storage", keys)
    # Asked of the index (or the one file's header) first: a key missing from an index
    # would otherwise open every shard to list what is there.
    if matrix.index is not None and projection not in _weight_map(matrix.index):
        return Tie(projection, True, _declared_tie(matrix, checkpoint, projection), keys)
    try:
        other = open_matrix(checkpoint, projection)
    except KeyMissing:
        return Tie(projection, True, _declared_tie(matrix, checkpoint, projection), keys)
    with other:
        if other.shape != matrix.shape or other.dtype != matrix.dtype:
            found = f"{list(other.shape)} {other.dtype}"
            return Tie(projection, False, f"a different matrix ({found})", keys)
        if not _equal_rows(matrix, other):
            return Tie(projection, False, "different values", keys)
    return Tie(projection, True, "equal values", keys)


# --- sharded checkpoints ------------------------------------------------------------------


def shard_files(index: Path) -> list[Path]:
    """Every shard a sharded checkpoint's index names, each once, in name order."""
    return [_member(index, name) for name in sorted(set(_weight_map(index).values()))]


def _shard_of(index: Path, key: str) -> Path:
    """The shard that an index's weight_map names for ``key``; reads nothing else."""
    weight_map = _weight_map(index)
    name = weight_map.get(key)
    if name is None:
        shapes: dict[str, list[int]] = {}
        for shard in sorted(set(weight_map.values())):
            shapes.update(tensor_shapes(_member(index, shard)))
        raise missing_key(key, index, shapes)
    return _member(index, name)


def _weight_map(index: Path) -> dict[str, str]:
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read checkpoint index {index.name}: {exc}") from exc
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"{index.name}: not a checkpoint index (expected a weight_map of keys to shard files)"
        )
    return weight_map


def _member(index: Path, name: str) -> Path:
    """A shard named by an index: a file beside it, never outside its directory."""
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise CheckpointError(f"{index.name}: shard {name!r} is outside the index's directory")
    shard = index.parent.joinpath(*relative.parts)
    if not shard.is_file():
        raise CheckpointError(f"checkpoint not found: {shard} (a shard {index.name} names)")
    return shard


def _declared_tie(matrix: CheckpointMatrix, checkpoint: Path, projection: str) -> str:
    """The evidence of a tie that transformers saved once: its config.json declares it."""
    config_path = checkpoint.parent / CONFIG_NAME
    where = f"--output-projection {projection!r} is not in {checkpoint.name}"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{where}, and no {CONFIG_NAME} beside it declares a tie") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {config_path}: {exc}") from exc
    if not isinstance(config, dict) or config.get("tie_word_embeddings") is not True:
        raise CheckpointError(
            f"{where}, and {config_path.name} does not declare tie_word_embeddings: true"
        )
    # The declaration is about the model's word embeddings: the exported matrix must be
    # of their shape, which the config states too.
    vocab_size, d_model = matrix.shape
    # ALBERT's table is [V, embedding_size], narrower than its hidden_size.
    width = next(
        (config[k] for k in ("embedding_size", "d_model", "n_embd", "hidden_size") if k in config),
        None,
    )
    if config.get("vocab_size") != vocab_size or width != d_model:
        raise CheckpointError(
            f"{where}; {config_path.name} declares tie_word_embeddings for a "
            f"[{config.get('vocab_size')}, {width}] vocabulary, but {matrix.key!r} is "
            f"[{vocab_size}, {d_model}]"
        )
    return f"{CONFIG_NAME}: tie_word_embeddings (the checkpoint stores the tied matrix once)"


def _equal_rows(first: CheckpointMatrix, second: CheckpointMatrix) -> bool:
    """Bit for bit, a slice at a time (so -0.0 and 0.0 differ, and equal NaNs are equal)."""
    for start, rows in first.slices(_COMPARE_BYTES):
        theirs = second.rows(start, start + len(rows))
        second.release()
        if not torch.equal(rows.view(torch.uint8), theirs.view(torch.uint8)):
            return False
    return True
