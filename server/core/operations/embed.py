"""The embed operation: ids ``[B,S]`` (or ragged) in, ``hidden_states [B,S,D]`` out; or
sequence-first, ``[S,B]`` in and ``[S,B,D]`` out (ragged: ``[S_max,B,D]``).

Validation runs before a request can join a batch, so a bad request fails alone, with a
message naming the offending value. It checks ids against their bound itself:
onnxruntime's CPU Gather silently wraps -1 to the last row and its CUDA Gather writes
zeros for ids out of range. The ids a request must carry are the model kind's
(``tokembed.export.kinds``): ``input_ids``, and whatever further inputs a kind declares.

The request as a front end hands it over, and what is checked of it before its inputs
are read: ``embed_request``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import numpy as np

from tokembed.server.backends.base import Backend, LookUp, Rows
from tokembed.server.core.dtypes import OUTPUT_DTYPES, DType
from tokembed.server.core.errors import Internal, InvalidInput, TooLarge
from tokembed.server.core.operations.base import Operation
from tokembed.server.core.operations.embed_request import BATCH_FIRST as BATCH_FIRST
from tokembed.server.core.operations.embed_request import FLAT as FLAT
from tokembed.server.core.operations.embed_request import PADDED as PADDED
from tokembed.server.core.operations.embed_request import SEQUENCE_FIRST as SEQUENCE_FIRST
from tokembed.server.core.operations.embed_request import EmbedInput as EmbedInput
from tokembed.server.core.operations.embed_request import IdsInput as IdsInput
from tokembed.server.core.operations.embed_request import (
    check_data_size,
    check_names,
    check_tokens,
    ids_dtype,
    in_hand,
    read_inputs,
)
from tokembed.server.core.served import ServedModel
from tokembed.server.core.types import Answer, Buffer, Timings, TokenIds


@dataclass(slots=True)
class EmbedJob:
    """A validated request: the look-up (ids in range), how to shape the answer, its size."""

    look_up: LookUp
    batch: int  # B
    seq_len: int  # S (rectangular) or S_max (ragged)
    lengths: tuple[int, ...] | None  # ragged input only
    layout: str
    output_bytes: int
    tokens: int
    sequence_first: bool = False  # ids [S, B], answer [S, B, D] (ragged: [S_max, B, D])

    @property
    def output_dtype(self) -> DType:
        return self.look_up.dtype

    @property
    def padded(self) -> bool:
        """Ragged input answered [B, S_max, D] (or [S_max, B, D]): with padding rows."""
        return self.lengths is not None and self.layout == PADDED

    def answer_shape(self, d_model: int) -> tuple[int, ...]:
        if self.lengths is not None and self.layout == FLAT:
            return (self.tokens, d_model)
        if self.sequence_first:
            return (self.seq_len, self.batch, d_model)
        return (self.batch, self.seq_len, d_model)


class Embed(Operation[EmbedInput, EmbedJob, Rows]):
    name = "embed"

    def validate(self, request: EmbedInput, model: ServedModel) -> EmbedJob:
        return validate(request, model)

    def unread(self, request: EmbedInput) -> bool:
        return (
            not isinstance(request.data, bytes)
            or request.lengths_input is not None
            or any(not isinstance(sent.data, bytes) for sent in (request.more_ids or {}).values())
        )

    async def read(self, request: EmbedInput, model: ServedModel) -> EmbedInput:
        return await read_inputs(request, model)

    def compute(self, backend: Backend, jobs: Sequence[EmbedJob]) -> list[Rows]:
        return backend.look_up_batch([job.look_up for job in jobs])

    def answer(self, job: EmbedJob, result: Rows, timings: Timings, model: ServedModel) -> Answer:
        """The answer's shape and pieces: the rows in the order of the ids (rectangular
        answers, batch- or sequence-first alike, and flat ones), with padding rows after
        each sequence of a padded ragged answer, or, sequence-first, position by position:
        the sequences' rows at position 0, then at 1, padding where one has ended."""
        if len(result) != job.tokens:
            raise Internal(f"this is a bug: the look-up gave {len(result)} rows for "
                           f"{job.tokens} ids")  # fmt: skip
        pieces: Sequence[Buffer]
        if job.padded and job.sequence_first:
            assert job.lengths is not None
            pad = model.backend.pad_row(job.output_dtype)
            pieces = _positions_first(
                result, job.lengths, job.seq_len, pad, model.d_model * job.output_dtype.itemsize
            )
        elif job.padded:
            assert job.lengths is not None
            pad = model.backend.pad_row(job.output_dtype)
            padded: list[Buffer] = []
            offset = 0
            for length in job.lengths:
                padded += result.pieces(offset, offset + length)
                padded += [pad] * (job.seq_len - length)
                offset += length
            pieces = padded
        else:
            pieces = result.pieces(0, job.tokens)
        return Answer(
            job.answer_shape(model.d_model), job.output_dtype, pieces, job.lengths, timings,
            job.tokens, job.output_bytes, model.name, model.version,
        )  # fmt: skip


EMBED = Embed()


def _positions_first(
    result: Rows, lengths: tuple[int, ...], seq_len: int, pad: Buffer, row_bytes: int
) -> list[Buffer]:
    """A ragged answer's pieces in ``[S_max, B]`` order: row by row (a backend's pieces
    may hold several rows of one sequence; they are split into rows, as views)."""
    rows: list[Buffer] = []
    for piece in result.pieces(0, len(result)):
        if len(piece) == row_bytes:
            rows.append(piece)
        else:
            view = memoryview(piece)
            rows += [view[i : i + row_bytes] for i in range(0, len(view), row_bytes)]
    starts = [0] * len(lengths)
    for index in range(1, len(lengths)):
        starts[index] = starts[index - 1] + lengths[index - 1]
    pieces: list[Buffer] = []
    for position in range(seq_len):
        pieces += [
            rows[start + position] if position < length else pad
            for start, length in zip(starts, lengths, strict=True)
        ]
    return pieces


def validate(request: EmbedInput, model: ServedModel) -> EmbedJob:
    check_names(request, model)
    data = in_hand(request.data)
    id_dtype = ids_dtype("input_ids", request.ids_dtype)
    output_dtype = OUTPUT_DTYPES.get(request.output_dtype)
    if output_dtype is None:
        *others, last = OUTPUT_DTYPES
        raise InvalidInput(
            f"output_dtype {request.output_dtype} is not supported; ask for "
            f"{', '.join(others)} or {last}"
        )
    # The layout only shapes ragged answers (the proto says so); ignore it otherwise.
    if request.lengths and request.layout not in (PADDED, FLAT):
        raise InvalidInput(f"ragged_layout {request.layout} is not supported; use PADDED or FLAT")
    if request.order not in (BATCH_FIRST, SEQUENCE_FIRST):
        raise InvalidInput(
            f"layout {request.order} is not supported; use BATCH_FIRST or SEQUENCE_FIRST"
        )
    sequence_first = request.order == SEQUENCE_FIRST
    if sequence_first and request.lengths and request.layout == FLAT:
        raise InvalidInput(
            "ragged_layout FLAT answers [N, D], which has no batch axis to put second: "
            "SEQUENCE_FIRST ragged answers are PADDED ([S_max, B, D])"
        )

    shape = request.shape
    if shape and min(shape) < 0:
        raise InvalidInput(f"input_ids shape {list(shape)} has a negative dimension")
    if request.lengths:
        batch, seq_len, tokens = _ragged_geometry(shape, request.lengths)
    else:
        axes = "[S, B] (sequence-first)" if sequence_first else "[B, S]"
        if len(shape) != 2:
            raise InvalidInput(
                f"input_ids shape {list(shape)} must be {axes} (or [N] with lengths for ragged "
                "input)"
            )
        batch, seq_len = (shape[1], shape[0]) if sequence_first else (shape[0], shape[1])
        tokens = batch * seq_len
        if tokens == 0:
            raise InvalidInput(f"input_ids shape {list(shape)} is empty; send at least one id")
    # Python ints: a huge declared shape cannot overflow into a plausible size.
    check_data_size("input_ids", data, shape, id_dtype, tokens)
    check_tokens(tokens, model)
    limits = model.limits
    layout = request.layout if request.lengths else PADDED
    rows = batch * seq_len if layout == PADDED else tokens
    output_bytes = rows * model.d_model * output_dtype.itemsize
    if output_bytes > limits.max_output_bytes_per_request:
        raise TooLarge(
            f"response would be {output_bytes} bytes ({rows} rows x {model.d_model} x "
            f"{output_dtype.name}), over the limit of {limits.max_output_bytes_per_request} "
            "bytes per request; split it or ask for float16"
        )

    ids = TokenIds(data, id_dtype, tokens)
    if not within_bound(ids, model.bounds[0]):
        _refuse_bound(model.inputs[0].name, ids, shape, model.bounds[0])
    more = None
    if request.more_ids or len(model.inputs) > 1:
        more = _more_ids(request, shape, tokens, model)
    return EmbedJob(
        LookUp(ids, output_dtype, more), batch, seq_len,
        tuple(request.lengths) if request.lengths else None, layout, output_bytes, tokens,
        sequence_first,
    )  # fmt: skip


def _more_ids(
    request: EmbedInput, shape: tuple[int, ...], tokens: int, model: ServedModel
) -> dict[str, TokenIds] | None:
    """The kind's further id inputs, validated as the ids are. An optional one not sent
    is left out: every backend computes it as 0s (``LookUp.more``)."""
    inputs = model.inputs[1:]
    given = dict(request.more_ids or {})
    if not inputs:
        return None
    more: dict[str, TokenIds] = {}
    for spec, bound in zip(inputs, model.bounds[1:], strict=True):
        sent = given.get(spec.name)
        if sent is None:
            if not spec.optional:
                raise InvalidInput(f"{spec.name} is missing; model {model.name!r} needs it")
            continue
        dtype = ids_dtype(spec.name, sent.dtype)
        if sent.shape != shape:
            raise InvalidInput(
                f"{spec.name} shape {list(sent.shape)} differs from input_ids shape {list(shape)}"
            )
        data = in_hand(sent.data)
        check_data_size(spec.name, data, shape, dtype, tokens)
        ids = TokenIds(data, dtype, tokens)
        if not within_bound(ids, bound):
            _refuse_bound(spec.name, ids, shape, bound)
        more[spec.name] = ids
    return more


def request_over_limit(size: int, max_bytes: int, max_tokens: int) -> TooLarge:
    """A request of ``size`` bytes, over ``max_bytes`` (what ``max_tokens`` ids allow):
    refused before it is decoded, by every front end."""
    return TooLarge(
        f"the request is {size} bytes, over the limit of {max_bytes} bytes that "
        f"max_tokens_per_request={max_tokens} allows; split it, or raise "
        "--max-tokens-per-request (TOKEMBED_MAX_TOKENS_PER_REQUEST)"
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
# whose per-call machinery dominates a tiny request;
# the ints are what a table look-up slices rows by anyway.
_PYTHON_BOUNDS_MAX_IDS = 64


def within_bound(ids: TokenIds, bound: int) -> bool:
    """Whether every id is in [0, bound)."""
    if ids.count <= _PYTHON_BOUNDS_MAX_IDS:
        values = ids.values()
        return min(values) >= 0 and max(values) < bound
    array = ids.array()
    return int(array.min()) >= 0 and int(array.max()) < bound


def _refuse_bound(name: str, ids: TokenIds, shape: tuple[int, ...], bound: int) -> NoReturn:
    """``InvalidInput`` naming the first id outside ``[0, bound)``, where it is, and how
    many there are."""
    array = ids.array()
    bad = np.flatnonzero((array < 0) | (array >= bound))
    first = int(bad[0])
    where = list(np.unravel_index(first, shape)) if len(shape) == 2 else [first]
    index = ",".join(str(int(i)) for i in where)
    more = f" ({bad.size} ids in all)" if bad.size > 1 else ""
    what = "the vocabulary" if name == "input_ids" else "its range"
    raise InvalidInput(
        f"{name}[{index}] = {int(array[first])} is outside {what} [0, {bound}){more}"
    )
