"""One checkpoint file, read by key, never executing pickled code: a torch state_dict
(``.pt``, ``.pth``, ``.bin``) or a ``.safetensors`` file.

``open_file_matrix`` gives a ``CheckpointMatrix``: the matrix's shape and dtype, and its
rows a slice at a time, so that neither the file nor the matrix is ever held in memory
whole (a safetensors tensor is read from its offset in the file, with plain reads, never
mapped; a torch zip file is memory-mapped). export/weights.py finds the file (a sharded
checkpoint's index names it) and builds on this.
"""

from __future__ import annotations

import difflib
import io
import json
import math
import sys
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokembed.export.dtypes import SAFETENSORS_DTYPES, torch_dtype
from tokembed.export.errors import CheckpointError

_TORCH_SUFFIXES = (".pt", ".pth", ".bin")
_SAFETENSORS_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".index.json"
# safetensors' own limit on a header (the format's specification).
_MAX_HEADER_BYTES = 100 * 1024 * 1024


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
        rows of a large file left most of it resident."""

    def close(self) -> None:
        """Let go of the file."""

    def __enter__(self) -> CheckpointMatrix:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KeyMissing(CheckpointError):
    """The key is in no tensor of the checkpoint."""


def open_file_matrix(file: Path, key: str, index: Path | None = None) -> CheckpointMatrix:
    """The 2-D float matrix at ``key`` in one checkpoint file; ``index``: the sharded
    checkpoint's index that named ``file`` (its messages name the index)."""
    _check_suffix(file)
    if file.suffix.lower() == _SAFETENSORS_SUFFIX:
        return _SafetensorsMatrix(file, key, index)
    return _TorchMatrix(file, key, index)


def _check_suffix(path: Path) -> None:
    suffix = path.suffix.lower()
    if suffix not in (*_TORCH_SUFFIXES, _SAFETENSORS_SUFFIX):
        raise CheckpointError(
            f"{path.name}: unknown checkpoint type {suffix!r}; expected one of "
            f"{[*_TORCH_SUFFIXES, _SAFETENSORS_SUFFIX]} or a sharded checkpoint's "
            f"*{_SAFETENSORS_SUFFIX}{INDEX_SUFFIX} / *.bin{INDEX_SUFFIX}"
        )


def missing_key(key: str, path: Path, shapes: Mapping[str, list[int]]) -> KeyMissing:
    matrices = sorted(name for name, shape in shapes.items() if len(shape) == 2)
    near = near_keys(key, matrices)
    return KeyMissing(
        f"key {key!r} not found in {path.name}; keys holding 2-D matrices: "
        + (", ".join(matrices) if matrices else "(none)")
        + (f"; did you mean {' or '.join(map(repr, near))}?" if near else "")
    )


def near_keys(key: str, names: list[str]) -> list[str]:
    """The names ``key`` was probably meant as: those whose dotted tail it is (a model saved
    under a prefix: ``bert.embeddings...``), those that are its dotted tail (saved without
    one), else the closest spellings."""
    tails = [n for n in names if n.endswith(f".{key}") or key.endswith(f".{n}")]
    return tails[:3] or difflib.get_close_matches(key, names, n=3, cutoff=0.8)


def _check_matrix(key: str, path: Path, shape: list[int], dtype: object) -> tuple[int, int]:
    if len(shape) != 2:
        raise CheckpointError(
            f"{key!r} in {path.name} has shape {shape}, expected a 2-D [V, D] matrix"
        )
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise CheckpointError(f"{key!r} in {path.name} is {dtype}, expected a float matrix")
    return shape[0], shape[1]


def tensor_shapes(path: Path) -> dict[str, list[int]]:
    """The shape of every tensor in one file (for the message that lists them)."""
    _check_suffix(path)
    if path.suffix.lower() == _SAFETENSORS_SUFFIX:
        header, _ = _safetensors_header(path)
        return {name: entry.shape for name, entry in header.items()}
    return {name: list(t.shape) for name, t in torch_tensors(path).items()}


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
    torch_name = SAFETENSORS_DTYPES.get(dtype_name)
    dtype: torch.dtype | str = dtype_name if torch_name is None else torch_dtype(torch_name)
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
            raise missing_key(key, index or path, {n: e.shape for n, e in header.items()})
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


def torch_tensors(path: Path) -> dict[str, torch.Tensor]:
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
        tensors = torch_tensors(path)
        tensor = tensors.get(key)
        if tensor is None:
            raise missing_key(key, index or path, {n: list(t.shape) for n, t in tensors.items()})
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
            self._tensor = torch_tensors(self.file)[self.key].detach()
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
