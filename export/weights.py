"""Reading a matrix from a checkpoint, by key, never executing pickled code.

A checkpoint is a torch state_dict (``.pt``, ``.pth``, ``.bin``), a ``.safetensors`` file,
or the index of a sharded one (``*.safetensors.index.json``, ``pytorch_model.bin.index.json``),
whose ``weight_map`` names the shard that holds each key: only that shard is opened.

``open_matrix`` gives a ``CheckpointMatrix``: the matrix's shape and dtype, and its rows a
slice at a time, so that neither the checkpoint nor the matrix is ever held in memory
whole (a safetensors tensor is read from its offset in the file, with plain reads, never
mapped; a torch zip file is memory-mapped). ``load_matrix`` reads a matrix whole, as
float32. ``find_tie`` says whether the matrix is also the model's output projection.
"""

from __future__ import annotations

import io
import json
import math
import sys
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch

from tokembed.export.errors import CheckpointError
from tokembed.export.hashing import Progress
from tokembed.export.manifest import Tie

_TORCH_SUFFIXES = (".pt", ".pth", ".bin")
_SAFETENSORS_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".index.json"
# The file transformers writes beside a checkpoint: the model's configuration.
CONFIG_NAME = "config.json"
# safetensors' own limit on a header (the format's specification).
_MAX_HEADER_BYTES = 100 * 1024 * 1024
# Rows are compared (ties) this many bytes at a time.
_COMPARE_BYTES = 32 * 1024 * 1024

# safetensors' dtype names, as torch names them.
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointMatrix:
    """A 2-D float matrix in a checkpoint, read a slice of rows at a time."""

    key: str
    file: Path  # the file that holds it: the checkpoint, or the shard an index names
    index: Path | None  # the index that named ``file``, for a sharded checkpoint
    shape: tuple[int, int]
    dtype: torch.dtype
    # Other keys of ``file`` that name this very tensor (a torch file stores tied weights
    # once, under each of their names); safetensors cannot alias, so none there.
    aliases: tuple[str, ...] = ()

    @property
    def row_bytes(self) -> int:
        return self.shape[1] * self.dtype.itemsize

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` in the checkpoint's dtype, a tensor of their own."""
        raise NotImplementedError

    def take(self, ids: np.ndarray) -> torch.Tensor:
        """The rows of ``ids`` (int64, 1-D, in ``[0, V)``) in their order."""
        raise NotImplementedError

    def slices(self, chunk_bytes: int) -> Iterator[tuple[int, torch.Tensor]]:
        """``(start, rows)`` over the whole matrix, ``chunk_bytes`` of rows at a time; what
        reading each slice held is let go before the next (``release``)."""
        step = max(1, chunk_bytes // max(1, self.row_bytes))
        for start in range(0, self.shape[0], step):
            rows = self.rows(start, min(self.shape[0], start + step))
            self.release()
            yield start, rows

    def release(self) -> None:
        """Let go of what reading held in memory; the next read opens the file again.

        A memory-mapped file keeps every page read through the mapping resident, and
        counted as this process's, until it is unmapped; and the kernel maps pages around
        each one read (whole large folios of the page cache, here): a few hundred random
        rows of a 1 GiB file left 600 MiB of it resident."""

    def close(self) -> None:
        """Let go of the file."""

    def __enter__(self) -> CheckpointMatrix:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_matrix(path: Path, key: str) -> CheckpointMatrix:
    """The 2-D float matrix at ``key`` in the checkpoint (or sharded checkpoint) ``path``."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    index: Path | None = None
    file = path
    if path.name.endswith(INDEX_SUFFIX):
        index, file = path, _shard_of(path, key)
    _check_suffix(file)
    if file.suffix.lower() == _SAFETENSORS_SUFFIX:
        matrix: CheckpointMatrix = _SafetensorsMatrix(file, key, index)
    else:
        matrix = _TorchMatrix(file, key, index)
    return matrix


def load_matrix(path: Path, key: str) -> torch.Tensor:
    """The 2-D float tensor stored under ``key`` in a state_dict, a safetensors file or a
    sharded checkpoint's index, read whole and widened to float32, a copy of its own."""
    with open_matrix(path, key) as matrix:
        progress = Progress(f"loading {matrix.file.name}", matrix.shape[0] * matrix.row_bytes)
        progress.update(0)
        rows = matrix.rows(0, matrix.shape[0])
        progress.update(matrix.shape[0] * matrix.row_bytes)
        progress.close()
    # rows is a fresh tensor already; widening makes another only when the dtype differs.
    return rows.to(torch.float32)


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
    except _KeyMissing:
        return Tie(projection, True, _declared_tie(matrix, checkpoint, projection), keys)
    with other:
        if other.shape != matrix.shape or other.dtype != matrix.dtype:
            found = f"{list(other.shape)} {other.dtype}"
            return Tie(projection, False, f"a different matrix ({found})", keys)
        if not _equal_rows(matrix, other):
            return Tie(projection, False, "different values", keys)
    return Tie(projection, True, "equal values", keys)


# --- sharded checkpoints ------------------------------------------------------------------


class _KeyMissing(CheckpointError):
    """The key is in no tensor of the checkpoint."""


def _shard_of(index: Path, key: str) -> Path:
    """The shard that an index's weight_map names for ``key``; reads nothing else."""
    weight_map = _weight_map(index)
    name = weight_map.get(key)
    if name is None:
        shapes: dict[str, list[int]] = {}
        for shard in sorted(set(weight_map.values())):
            shapes.update(_shapes(_member(index, shard)))
        raise _missing(key, index, shapes)
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
    width = next((config[k] for k in ("d_model", "hidden_size") if k in config), None)
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


# --- one file -----------------------------------------------------------------------------


def _check_suffix(path: Path) -> None:
    suffix = path.suffix.lower()
    if suffix not in (*_TORCH_SUFFIXES, _SAFETENSORS_SUFFIX):
        raise CheckpointError(
            f"{path.name}: unknown checkpoint type {suffix!r}; expected one of "
            f"{[*_TORCH_SUFFIXES, _SAFETENSORS_SUFFIX]} or a sharded checkpoint's "
            f"*{_SAFETENSORS_SUFFIX}{INDEX_SUFFIX} / *.bin{INDEX_SUFFIX}"
        )


def _missing(key: str, path: Path, shapes: Mapping[str, list[int]]) -> _KeyMissing:
    matrices = sorted(name for name, shape in shapes.items() if len(shape) == 2)
    return _KeyMissing(
        f"key {key!r} not found in {path.name}; keys holding 2-D matrices: "
        + (", ".join(matrices) if matrices else "(none)")
    )


def _check_matrix(key: str, path: Path, shape: list[int], dtype: object) -> tuple[int, int]:
    if len(shape) != 2:
        raise CheckpointError(
            f"{key!r} in {path.name} has shape {shape}, expected a 2-D [V, D] matrix"
        )
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise CheckpointError(f"{key!r} in {path.name} is {dtype}, expected a float matrix")
    return shape[0], shape[1]


def _shapes(path: Path) -> dict[str, list[int]]:
    """The shape of every tensor in one file (for the message that lists them)."""
    _check_suffix(path)
    if path.suffix.lower() == _SAFETENSORS_SUFFIX:
        header, _ = _safetensors_header(path)
        return {name: entry.shape for name, entry in header.items()}
    return {name: list(t.shape) for name, t in _torch_tensors(path).items()}


def _unreadable(path: Path, exc: BaseException) -> CheckpointError:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CheckpointError(f"cannot read checkpoint {path.name}: {first_line}")


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype | str  # the safetensors name when torch has no such dtype
    shape: list[int]
    begin: int  # offsets in the data, after the header
    end: int


def _safetensors_header(path: Path) -> tuple[dict[str, _Entry], int]:
    """The tensors a safetensors file holds, and where its data starts.

    Read by hand (the format is an 8-byte little-endian length, that many bytes of JSON,
    then the data) so that the tensor can then be read at its offset with plain reads:
    safetensors' own readers map the file, and every page read through a mapping stays
    resident in the process until it is unmapped.
    """
    size = path.stat().st_size
    try:
        with path.open("rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise ValueError(f"{size} bytes, too short for a safetensors header")
            length = int.from_bytes(head, "little")
            if length > min(size - 8, _MAX_HEADER_BYTES):
                raise ValueError(f"header length {length} does not fit the file's {size} bytes")
            raw = json.loads(handle.read(length))
        if not isinstance(raw, dict):
            raise ValueError("the header is not a JSON object")
        data_start, data_bytes = 8 + length, size - 8 - length
        entries = {
            str(name): _entry(str(name), value, data_bytes)
            for name, value in raw.items()
            if name != "__metadata__"
        }
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise _unreadable(path, exc) from exc
    return entries, data_start


def _entry(name: str, value: Any, data_bytes: int) -> _Entry:
    if not isinstance(value, dict):
        raise ValueError(f"tensor {name!r}: not an object")
    dtype_name, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(dtype_name, str):
        raise ValueError(f"tensor {name!r}: no dtype")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise ValueError(f"tensor {name!r}: shape {shape!r}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) for o in offsets)
        and 0 <= offsets[0] <= offsets[1] <= data_bytes
    ):
        raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} outside the data")
    dtype: torch.dtype | str = _SAFETENSORS_DTYPES.get(dtype_name, dtype_name)
    if isinstance(dtype, torch.dtype) and offsets[1] - offsets[0] != math.prod(shape) * (
        dtype.itemsize
    ):
        raise ValueError(f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for shape {shape}")
    return _Entry(dtype, shape, offsets[0], offsets[1])


class _SafetensorsMatrix(CheckpointMatrix):
    """Rows read from the file at the tensor's offset into tensors of their own."""

    def __init__(self, path: Path, key: str, index: Path | None) -> None:
        if sys.byteorder != "little":
            raise CheckpointError("safetensors checkpoints are read on little-endian machines only")
        header, data_start = _safetensors_header(path)
        entry = header.get(key)
        if entry is None:
            raise _missing(key, index or path, {n: e.shape for n, e in header.items()})
        self.shape = _check_matrix(key, path, entry.shape, entry.dtype)
        assert isinstance(entry.dtype, torch.dtype), "This is a bug."
        self.dtype = entry.dtype
        self.key, self.file, self.index = key, path, index
        self._offset = data_start + entry.begin
        self._handle: io.BufferedReader = path.open("rb")

    def rows(self, start: int, stop: int) -> torch.Tensor:
        out = torch.empty((stop - start, self.shape[1]), dtype=self.dtype)
        self._read_into(out, start)
        return out

    def take(self, ids: np.ndarray) -> torch.Tensor:
        out = torch.empty((len(ids), self.shape[1]), dtype=self.dtype)
        # Read in the file's order, one read per run of consecutive ids.
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        breaks = np.flatnonzero(np.diff(sorted_ids) != 1) + 1
        rows = torch.empty_like(out)
        for run in np.split(np.arange(len(ids)), breaks):
            if run.size:
                self._read_into(rows[run[0] : run[-1] + 1], int(sorted_ids[run[0]]))
        out[torch.from_numpy(order)] = rows
        return out

    def _read_into(self, out: torch.Tensor, start: int) -> None:
        view = out.view(torch.uint8).numpy().reshape(-1)
        self._handle.seek(self._offset + start * self.row_bytes)
        done = self._handle.readinto(view.data)
        if done != view.nbytes:
            raise CheckpointError(f"cannot read checkpoint {self.file.name}: the file is truncated")

    def close(self) -> None:
        self._handle.close()


def _torch_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        # weights_only: a checkpoint is data; never run the pickled code it may carry.
        # mmap: only the pages of the chosen tensor are read. torch can mmap only its
        # zip format (torch >= 1.6); older checkpoints (many early Hugging Face .bin
        # files) are read whole rather than refused.
        loaded = torch.load(
            str(path), map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path)
        )
    except Exception as exc:
        raise _unreadable(path, exc) from exc
    return _flatten(loaded, path)


class _TorchMatrix(CheckpointMatrix):
    """A tensor of a torch file, memory-mapped (zip format) or read whole (legacy)."""

    def __init__(self, path: Path, key: str, index: Path | None) -> None:
        tensors = _torch_tensors(path)
        tensor = tensors.get(key)
        if tensor is None:
            raise _missing(key, index or path, {n: list(t.shape) for n, t in tensors.items()})
        self.shape = _check_matrix(key, path, list(tensor.shape), tensor.dtype)
        self.dtype = tensor.dtype
        self.key, self.file, self.index = key, path, index
        self.aliases = tuple(
            sorted(name for name, t in tensors.items() if name != key and _same(t, tensor))
        )
        self._tensor: torch.Tensor | None = tensor.detach()
        # Only a zip file is mapped; a legacy file is read whole, so re-reading it for
        # every slice would cost the whole file each time and let go of nothing.
        self._mapped = zipfile.is_zipfile(path)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        # A copy: nothing handed out keeps the file's storage (every tied key) alive.
        return self._live()[start:stop].clone()

    def take(self, ids: np.ndarray) -> torch.Tensor:
        return self._live()[torch.from_numpy(ids)]

    def _live(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = _torch_tensors(self.file)[self.key].detach()
        return self._tensor

    def release(self) -> None:
        # The last reference to the mapping (the rows handed out are copies): every page
        # read through it stops counting as this process's.
        if self._mapped:
            self._tensor = None

    def close(self) -> None:
        self._tensor = None


def _same(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether two tensors are one: the same storage, offset, shape, stride and dtype."""
    return (
        first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
        and first.storage_offset() == second.storage_offset()
        and first.shape == second.shape
        and first.stride() == second.stride()
        and first.dtype == second.dtype
    )


def _flatten(loaded: object, path: Path) -> dict[str, torch.Tensor]:
    """A state_dict, possibly nested (``{"model": {...}}``), as dotted keys to tensors."""
    if isinstance(loaded, torch.Tensor):
        raise CheckpointError(f"{path.name} holds a bare tensor, not a state_dict with keys")
    if not isinstance(loaded, Mapping):
        raise CheckpointError(f"{path.name} holds a {type(loaded).__name__}, not a state_dict")
    flat: dict[str, torch.Tensor] = {}
    # A stack, not a recursive closure: a closure that calls itself is a reference cycle
    # holding ``flat``, and with it every tensor of the file (and a mapping's resident
    # pages) until the garbage collector happens to run.
    stack: list[tuple[str, Mapping[object, object]]] = [("", loaded)]
    while stack:
        prefix, node = stack.pop()
        for name, value in node.items():
            full = f"{prefix}{name}"
            if isinstance(value, torch.Tensor):
                flat[full] = value
            elif isinstance(value, Mapping):
                stack.append((f"{full}.", value))
    return flat
