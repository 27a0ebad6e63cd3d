"""Validation before batching: a bad request fails alone, with a message naming the value.

It runs before a request can join a batch, so it never fails its batch-mates. It also
checks ids against V itself: onnxruntime's CPU Gather silently wraps -1 to the last
row and its CUDA Gather writes zeros for ids out of range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tokembed.server.core.errors import InvalidInput, TooLarge
from tokembed.server.core.types import FLAT, OUTPUT_DTYPES, PADDED, EmbedInput, Job, TokenIds

_INT64 = np.dtype("<i8")
_ID_DTYPES: dict[str, np.dtype[Any]] = {"int64": _INT64, "int32": np.dtype("<i4")}


@dataclass(frozen=True)
class Limits:
    """What one model accepts: ids in [0, vocab_size), and the per-request limits."""

    vocab_size: int
    d_model: int
    max_tokens_per_request: int
    max_output_bytes_per_request: int


def validate(request: EmbedInput, limits: Limits) -> Job:
    id_dtype = _ID_DTYPES.get(request.ids_dtype)
    if id_dtype is None:
        raise InvalidInput(
            f"input_ids dtype {request.ids_dtype} is not supported; send int64 or int32"
        )
    output_dtype = OUTPUT_DTYPES.get(request.output_dtype)
    if output_dtype is None:
        raise InvalidInput(
            f"output_dtype {request.output_dtype} is not supported; ask for "
            f"{' or '.join(OUTPUT_DTYPES)}"
        )
    # The layout only shapes ragged answers (the proto says so); ignore it otherwise.
    if request.lengths and request.layout not in (PADDED, FLAT):
        raise InvalidInput(f"ragged_layout {request.layout} is not supported; use PADDED or FLAT")

    shape = request.shape
    if shape and min(shape) < 0:
        raise InvalidInput(f"input_ids shape {list(shape)} has a negative dimension")
    if request.lengths:
        batch, seq_len, tokens = _ragged_geometry(shape, request.lengths)
    else:
        if len(shape) != 2:
            raise InvalidInput(
                f"input_ids shape {list(shape)} must be [B, S] (or [N] with lengths for ragged "
                "input)"
            )
        batch, seq_len = shape
        tokens = batch * seq_len
        if tokens == 0:
            raise InvalidInput(f"input_ids shape {list(shape)} is empty; send at least one id")
    # Python ints: a huge declared shape cannot overflow into a plausible size.
    expected_bytes = tokens * id_dtype.itemsize
    if len(request.data) != expected_bytes:
        raise InvalidInput(
            f"input_ids data is {len(request.data)} bytes, but shape {list(shape)} of "
            f"{request.ids_dtype} needs {expected_bytes}"
        )
    if tokens > limits.max_tokens_per_request:
        raise TooLarge(
            f"request has {tokens} tokens, over the limit of {limits.max_tokens_per_request} "
            "per request; split it"
        )
    layout = request.layout if request.lengths else PADDED
    rows = batch * seq_len if layout == PADDED else tokens
    output_bytes = rows * limits.d_model * output_dtype.itemsize
    if output_bytes > limits.max_output_bytes_per_request:
        raise TooLarge(
            f"response would be {output_bytes} bytes ({rows} rows x {limits.d_model} x "
            f"{output_dtype.name}), over the limit of {limits.max_output_bytes_per_request} "
            "bytes per request; split it or ask for float16"
        )

    ids = TokenIds(request.data, id_dtype, tokens)
    _check_vocabulary(ids, shape, limits.vocab_size)
    return Job(
        ids=ids,
        batch=batch,
        seq_len=seq_len,
        lengths=tuple(request.lengths) if request.lengths else None,
        output_dtype=output_dtype,
        layout=layout,
        output_bytes=output_bytes,
    )


def _ragged_geometry(shape: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[int, int, int]:
    if len(shape) != 1:
        raise InvalidInput(
            f"input_ids shape {list(shape)} must be [N] (flat) when lengths are given"
        )
    for index, length in enumerate(lengths):
        if length <= 0:
            raise InvalidInput(f"lengths[{index}] = {length}; every sequence needs >= 1 id")
    total = sum(lengths)
    if total != shape[0]:
        raise InvalidInput(
            f"lengths sum to {total}, but input_ids holds {shape[0]} ids (shape {list(shape)})"
        )
    return len(lengths), max(lengths), total


# Up to this many ids, Python's min() and max() over their ints beat numpy's reductions,
# whose per-call machinery dominates a tiny request (~2 us against ~10 us in the server);
# the ints are what a table look-up slices rows by anyway.
_PYTHON_BOUNDS_MAX_IDS = 64


def within_vocabulary(ids: TokenIds, vocab_size: int) -> bool:
    """Whether every id is in [0, vocab_size)."""
    if ids.count <= _PYTHON_BOUNDS_MAX_IDS:
        values = ids.values()
        return min(values) >= 0 and max(values) < vocab_size
    array = ids.array()
    return int(array.min()) >= 0 and int(array.max()) < vocab_size


def _check_vocabulary(ids: TokenIds, shape: tuple[int, ...], vocab_size: int) -> None:
    if not within_vocabulary(ids, vocab_size):
        array = ids.array()
        bad = np.flatnonzero((array < 0) | (array >= vocab_size))
        first = int(bad[0])
        where = list(np.unravel_index(first, shape)) if len(shape) == 2 else [first]
        index = ",".join(str(int(i)) for i in where)
        more = f" ({bad.size} ids in all)" if bad.size > 1 else ""
        raise InvalidInput(
            f"input_ids[{index}] = {int(array[first])} is outside the vocabulary "
            f"[0, {vocab_size}){more}"
        )
