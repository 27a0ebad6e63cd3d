"""The embed operation: ids ``[B,S]`` (or ragged) in, ``hidden_states [B,S,D]`` out; or
sequence-first, ``[S,B]`` in and ``[S,B,D]`` out (ragged: ``[S_max,B,D]``).

Validation runs before a request can join a batch, so a bad request fails alone, with a
message naming the offending value. It checks ids against their bound itself:
onnxruntime's CPU Gather silently wraps -1 to the last row and its CUDA Gather writes
zeros for ids out of range. The ids a request must carry are the model kind's
(``tokembed.export.kinds``): ``input_ids``, and whatever further inputs a kind declares.

A front end may hand over inputs whose bytes are not read yet (``Unread``: a V2 input in
its message or in a shared-memory region). Their reading is a step of its own (``read``),
after what the request declares (its inputs' names, datatypes, shapes and sizes) is
checked against the model: a refused request has read nothing, and an accepted one reads
at most what its declared shapes need.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import numpy as np

from tokembed.server.backends.base import Backend, LookUp, Rows
from tokembed.server.core.dtypes import ID_DTYPES, OUTPUT_DTYPES, DType
from tokembed.server.core.errors import Internal, InvalidInput, TooLarge
from tokembed.server.core.operations.base import Operation
from tokembed.server.core.served import ServedModel
from tokembed.server.core.types import Answer, Buffer, Timings, TokenIds

PADDED = "padded"
FLAT = "flat"
# The order of the batch and sequence axes, of the ids and of the answer.
BATCH_FIRST = "batch_first"
SEQUENCE_FIRST = "sequence_first"


class Unread(ABC):
    """An input's bytes where the request left them, not yet taken."""

    __slots__ = ()

    @property
    @abstractmethod
    def nbytes(self) -> int | None:
        """The size the request declares for them (None: the bytes are in the request's
        own message, already received; their size is checked once taken)."""

    @abstractmethod
    async def read(self) -> bytes:
        """The bytes; raises ``EmbedError``. Called only once the request's declarations
        fit the model, so a region read is bounded by what its shape needs."""


@dataclass(slots=True)
class IdsInput:
    """Ids as decoded from the wire, not yet validated."""

    dtype: str  # "int64", "int32", or whatever else was sent (refused by validation)
    shape: tuple[int, ...]
    data: bytes | Unread


@dataclass(slots=True)
class EmbedInput:
    """An embed request as decoded from the wire, not yet validated. ``more_ids``: the
    model kind's further id inputs by name (``token_type_ids``), each of the ids' shape."""

    ids_dtype: str  # "int64", "int32", or whatever else was sent (refused by validation)
    shape: tuple[int, ...]
    data: bytes | Unread | None  # None: the request has no input_ids (V2 names its inputs)
    lengths: tuple[int, ...] = ()
    output_dtype: str = "float32"
    layout: str = PADDED
    more_ids: dict[str, IdsInput] | None = None
    order: str = BATCH_FIRST  # or SEQUENCE_FIRST, or whatever else was sent (refused)
    # The ragged lengths as an input not yet read (V2's ``lengths``); ``read`` makes them
    # ``lengths``.
    lengths_input: IdsInput | None = None


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
        """The request with its inputs' bytes read, once what it declares fits ``model``
        (``check_declared``); one input after the other, so at most one is being read."""
        check_declared(request, model)
        assert request.data is not None, "This is a bug: check_declared refuses it."
        more = None
        if request.more_ids:
            more = {
                name: IdsInput(sent.dtype, sent.shape, await _taken(sent.data))
                for name, sent in request.more_ids.items()
            }
        lengths = request.lengths
        if request.lengths_input is not None:
            sent = request.lengths_input
            lengths = lengths_of(IdsInput(sent.dtype, sent.shape, await _taken(sent.data)))
        return EmbedInput(
            request.ids_dtype, request.shape, await _taken(request.data), lengths,
            request.output_dtype, request.layout, more, request.order,
        )  # fmt: skip

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
        if job.padded and job.sequence_first:
            assert job.lengths is not None
            pad = model.backend.pad_row(job.output_dtype)
            pieces = _positions_first(
                result, job.lengths, job.seq_len, pad, model.d_model * job.output_dtype.itemsize
            )
        elif job.padded:
            assert job.lengths is not None
            pad = model.backend.pad_row(job.output_dtype)
            pieces = []
            offset = 0
            for length in job.lengths:
                pieces += result.pieces(offset, offset + length)
                pieces += [pad] * (job.seq_len - length)
                offset += length
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
    _check_names(request, model)
    data = _in_hand(request.data)
    id_dtype = _ids_dtype("input_ids", request.ids_dtype)
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
    _check_data_size("input_ids", data, shape, id_dtype, tokens)
    _check_tokens(tokens, model)
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
        dtype = _ids_dtype(spec.name, sent.dtype)
        if sent.shape != shape:
            raise InvalidInput(
                f"{spec.name} shape {list(sent.shape)} differs from input_ids shape {list(shape)}"
            )
        data = _in_hand(sent.data)
        _check_data_size(spec.name, data, shape, dtype, tokens)
        ids = TokenIds(data, dtype, tokens)
        if not within_bound(ids, bound):
            _refuse_bound(spec.name, ids, shape, bound)
        more[spec.name] = ids
    return more


# --- what a request declares, checked before its inputs are read


LENGTHS = "lengths"  # the ragged input's sequence lengths, in every protocol


def check_declared(request: EmbedInput, model: ServedModel) -> None:
    """What ``request`` declares, against ``model``, before a byte of its inputs is read:
    the inputs' names, their datatypes and shapes, the ids within the request's limit,
    and each size an input declares exactly what its shape needs. So a read that follows
    is bounded by the model's inputs times the limit, whatever the request names."""
    _check_names(request, model)
    assert request.data is not None, "This is a bug: _check_names refuses it."
    id_dtype = _ids_dtype("input_ids", request.ids_dtype)
    shape = request.shape
    if shape and min(shape) < 0:
        raise InvalidInput(f"input_ids shape {list(shape)} has a negative dimension")
    ragged = bool(request.lengths) or request.lengths_input is not None
    if len(shape) != (1 if ragged else 2):
        raise InvalidInput(
            f"input_ids shape {list(shape)} must be "
            + ("[N] (flat) when lengths are given" if ragged else "[B, S] (or [S, B])")
        )
    tokens = shape[0] if ragged else shape[0] * shape[1]
    _check_tokens(tokens, model)
    _check_declared_size("input_ids", request.data, shape, id_dtype, tokens)
    if request.lengths_input is not None:
        sent = request.lengths_input
        dtype = _ids_dtype(LENGTHS, sent.dtype)
        if len(sent.shape) != 1:
            raise InvalidInput(f"input {LENGTHS} shape {list(sent.shape)} must be [B]")
        if sent.shape[0] > tokens:
            raise InvalidInput(
                f"input {LENGTHS} holds {sent.shape[0]} sequences but input_ids only "
                f"{tokens} ids; every sequence needs >= 1 id"
            )
        _check_declared_size(LENGTHS, sent.data, sent.shape, dtype, sent.shape[0])
    for name, sent in (request.more_ids or {}).items():
        dtype = _ids_dtype(name, sent.dtype)
        if sent.shape != shape:
            raise InvalidInput(
                f"{name} shape {list(sent.shape)} differs from input_ids shape {list(shape)}"
            )
        _check_declared_size(name, sent.data, shape, dtype, tokens)


def lengths_of(sent: IdsInput) -> tuple[int, ...]:
    """The ragged lengths an input carries, as ints (validation checks them against the
    ids)."""
    dtype = _ids_dtype(LENGTHS, sent.dtype)
    data = _in_hand(sent.data)
    if len(sent.shape) != 1:
        raise InvalidInput(f"input {LENGTHS} shape {list(sent.shape)} must be [B]")
    _check_data_size(f"input {LENGTHS}", data, sent.shape, dtype, sent.shape[0])
    if not sent.shape[0]:
        raise InvalidInput(f"input {LENGTHS} is empty; send one length per sequence")
    return tuple(np.frombuffer(data, dtype=dtype.numpy).tolist())


def _check_names(request: EmbedInput, model: ServedModel) -> None:
    """Every input named is one the model takes, and its ids are there."""
    names = [spec.name for spec in model.inputs]
    for name in request.more_ids or ():
        if name not in names[1:]:
            raise InvalidInput(f"unexpected input {name!r}: {_takes(model, names)}")
    if request.data is None:
        raise InvalidInput(f"input {names[0]} is missing: {_takes(model, names)}")


def _takes(model: ServedModel, names: list[str]) -> str:
    return (
        f"model {model.name!r} ({model.kind.name} kind) takes {', '.join(names)} "
        f"(and {LENGTHS}, for ragged ids)"
    )


def _ids_dtype(name: str, sent: str) -> DType:
    dtype = ID_DTYPES.get(sent)
    if dtype is None:
        raise InvalidInput(f"{name} dtype {sent} is not supported; send int64 or int32")
    return dtype


def _check_tokens(tokens: int, model: ServedModel) -> None:
    limit = model.limits.max_tokens_per_request
    if tokens > limit:
        raise TooLarge(
            f"request has {tokens} tokens, over the limit of {limit} per request; split it"
        )


def _check_declared_size(
    name: str, data: bytes | Unread, shape: tuple[int, ...], dtype: DType, count: int
) -> None:
    """An input whose size is declared apart from its bytes (a region's window): that
    size is what its shape needs. Bytes in hand are checked by validation."""
    declared = data.nbytes if isinstance(data, Unread) else None
    if declared is not None and declared != count * dtype.itemsize:
        raise InvalidInput(
            f"{name} is declared as {declared} bytes, but shape {list(shape)} of "
            f"{dtype.name} needs {count * dtype.itemsize}"
        )


async def _taken(data: bytes | Unread) -> bytes:
    return data if isinstance(data, bytes) else await data.read()


def _in_hand(data: bytes | Unread | None) -> bytes:
    if not isinstance(data, bytes):
        raise Internal("this is a bug: an input was validated before it was read")
    return data


def request_over_limit(size: int, max_bytes: int, max_tokens: int) -> TooLarge:
    """A request of ``size`` bytes, over ``max_bytes`` (what ``max_tokens`` ids allow):
    refused before it is decoded, by every front end."""
    return TooLarge(
        f"the request is {size} bytes, over the limit of {max_bytes} bytes that "
        f"max_tokens_per_request={max_tokens} allows; split it, or raise "
        "--max-tokens-per-request (TOKEMBED_MAX_TOKENS_PER_REQUEST)"
    )


def _check_data_size(
    name: str, data: bytes, shape: tuple[int, ...], dtype: DType, tokens: int
) -> None:
    expected_bytes = tokens * dtype.itemsize
    if len(data) != expected_bytes:
        raise InvalidInput(
            f"{name} data is {len(data)} bytes, but shape {list(shape)} of "
            f"{dtype.name} needs {expected_bytes}"
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
