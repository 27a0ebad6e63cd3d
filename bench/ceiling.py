"""The ceiling: the service's own look-up, called in the bench's process.

What the service could reach if its transport, request parsing and client cost nothing:
the model loaded as ``tokembed serve`` loads it (``tokembed.server.models.loading``: the same
backend, tables and casts for the same device), its look-up called with each request's
ids, and the answer's bytes made once (``Rows.joined``): the rows the look-up gives (views
of the table's rows; padding rows follow each ragged sequence), joined into one buffer,
or for a large rectangular answer gathered by numpy into one array (the cheapest single
copy: numpy's gather lets go of the GIL), taken as they are where the look-up gives one
array (an onnxruntime run). That is the least any of the service's paths does: a unary
answer copies those rows once into its response, EmbedChunked into its chunks, a
shared-memory answer into its region. So a float16 answer comes from the float16 table,
as the service's does.

Why not an onnxruntime run per request, as the bench once had it: the service (on CPU)
answers from tables the model computed at load, so a run per request, and for float16 a
cast of its float32 output, is slower than the service it was meant to bound
(docs/benchmarks/README.md has the figures).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokembed.server.backends.base import Backend, LookUp
from tokembed.server.core.dtypes import INT64, OUTPUT_DTYPES
from tokembed.server.core.types import Buffer, TokenIds
from tokembed.server.models.loading import load_model
from tokembed.server.process.settings import Settings

_INT64 = np.dtype("<i8")


def load_backend(model_dir: Path, device: str) -> Backend:
    """The backend ``tokembed serve --device DEVICE`` would answer this model with
    (the request limits, which differ in the bench, do not change it)."""
    return load_model(model_dir, Settings(device=device)).backend


@dataclass(frozen=True)
class CeilingIds:
    """One request's ids as the server holds them once parsed: int64 bytes, their
    count, and the sequences' lengths when ragged (empty when rectangular)."""

    data: bytes
    count: int
    lengths: tuple[int, ...]


def ceiling_ids(ids: Any) -> CeilingIds:
    """A bench request (an int64 ``[B, S]`` array, or ragged lists) in the ceiling's form."""
    if isinstance(ids, np.ndarray):
        flat = np.ascontiguousarray(ids, dtype=_INT64).reshape(-1)
        return CeilingIds(flat.tobytes(), int(flat.size), ())
    rows = [np.asarray(row, dtype=_INT64) for row in ids]
    flat = np.concatenate(rows)
    return CeilingIds(flat.tobytes(), int(flat.size), tuple(len(row) for row in rows))


class Ceiling:
    """``ceiling(ids)``: the answer's bytes in ``dtype``, as the service computes them."""

    def __init__(self, backend: Backend, dtype: str) -> None:
        self._backend = backend
        self._dtype = OUTPUT_DTYPES[dtype]
        self._pad = backend.pad_row(self._dtype)

    def __call__(self, ids: CeilingIds) -> Buffer:
        rows = self._backend.look_up(LookUp(TokenIds(ids.data, INT64, ids.count), self._dtype))
        if not ids.lengths:
            return rows.joined()
        longest = max(ids.lengths)
        pieces: list[Buffer] = []
        offset = 0
        for length in ids.lengths:
            pieces += rows.pieces(offset, offset + length)
            pieces += [self._pad] * (longest - length)
            offset += length
        return b"".join(pieces)
