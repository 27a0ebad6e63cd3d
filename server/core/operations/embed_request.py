"""An embed request as a front end hands it over, and what is checked of it before its
inputs are read.

A front end may hand over inputs whose bytes it has not read (``Unread``: a V2 input's
typed contents in its message, or a shared-memory region). Reading them is a step of its
own (``read_inputs``, the operation's ``read``), after what the request declares (its
inputs' names, datatypes, shapes and sizes, and the size of any bytes already in hand)
is checked against the model: a refused request has read nothing, and an accepted one
reads at most what its declared shapes need. Validation (``embed.validate``) then checks
the bytes. A request whose inputs are all in hand skips the step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from tokembed.server.core.dtypes import ID_DTYPES, DType
from tokembed.server.core.errors import Internal, InvalidInput, TooLarge
from tokembed.server.core.served import ServedModel

PADDED = "padded"
FLAT = "flat"
# The order of the batch and sequence axes, of the ids and of the answer.
BATCH_FIRST = "batch_first"
SEQUENCE_FIRST = "sequence_first"


class Unread(ABC):
    """An input's bytes where the request left them, not yet taken."""

    __slots__ = ()
    # Whether ``nbytes`` is a size declared apart from the bytes (a region's window), not
    # that of bytes the request carries: what a refusal calls it.
    declared = True

    @property
    @abstractmethod
    def nbytes(self) -> int | None:
        """Their size: the one the request declares (a region's window), or that of the
        bytes already in its message (None: not known before they are taken; checked
        then)."""

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


async def read_inputs(request: EmbedInput, model: ServedModel) -> EmbedInput:
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


LENGTHS = "lengths"  # the ragged input's sequence lengths, in every protocol


def check_declared(request: EmbedInput, model: ServedModel) -> None:
    """What ``request`` declares, against ``model``, before a byte of its inputs is read:
    the inputs' names, their datatypes and shapes, the ids within the request's limit,
    and each size an input declares exactly what its shape needs. So a read that follows
    is bounded by the model's inputs times the limit, whatever the request names."""
    check_names(request, model)
    assert request.data is not None, "This is a bug: _check_names refuses it."
    id_dtype = ids_dtype("input_ids", request.ids_dtype)
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
    # Size before the limit, as validation orders them: a shape its bytes do not fill is
    # malformed (INVALID_ARGUMENT), not too large, however large it claims to be.
    _check_declared_size("input_ids", request.data, shape, id_dtype, tokens)
    check_tokens(tokens, model)
    if request.lengths_input is not None:
        sent = request.lengths_input
        dtype = ids_dtype(LENGTHS, sent.dtype)
        if len(sent.shape) != 1:
            raise InvalidInput(f"input {LENGTHS} shape {list(sent.shape)} must be [B]")
        if sent.shape[0] > tokens:
            raise InvalidInput(
                f"input {LENGTHS} holds {sent.shape[0]} sequences but input_ids only "
                f"{tokens} ids; every sequence needs >= 1 id"
            )
        _check_declared_size(LENGTHS, sent.data, sent.shape, dtype, sent.shape[0])
    for name, sent in (request.more_ids or {}).items():
        dtype = ids_dtype(name, sent.dtype)
        if sent.shape != shape:
            raise InvalidInput(
                f"{name} shape {list(sent.shape)} differs from input_ids shape {list(shape)}"
            )
        _check_declared_size(name, sent.data, shape, dtype, tokens)


def lengths_of(sent: IdsInput) -> tuple[int, ...]:
    """The ragged lengths an input carries, as ints (validation checks them against the
    ids)."""
    dtype = ids_dtype(LENGTHS, sent.dtype)
    data = in_hand(sent.data)
    if len(sent.shape) != 1:
        raise InvalidInput(f"input {LENGTHS} shape {list(sent.shape)} must be [B]")
    check_data_size(f"input {LENGTHS}", data, sent.shape, dtype, sent.shape[0])
    if not sent.shape[0]:
        raise InvalidInput(f"input {LENGTHS} is empty; send one length per sequence")
    return tuple(np.frombuffer(data, dtype=dtype.numpy).tolist())


def check_names(request: EmbedInput, model: ServedModel) -> None:
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


def ids_dtype(name: str, sent: str) -> DType:
    dtype = ID_DTYPES.get(sent)
    if dtype is None:
        raise InvalidInput(f"{name} dtype {sent} is not supported; send int64 or int32")
    return dtype


def check_tokens(tokens: int, model: ServedModel) -> None:
    limit = model.limits.max_tokens_per_request
    if tokens > limit:
        raise TooLarge(
            f"request has {tokens} tokens, over the limit of {limit} per request; split it"
        )


def _check_declared_size(
    name: str, data: bytes | Unread, shape: tuple[int, ...], dtype: DType, count: int
) -> None:
    """An input whose size is known before it is read (a region's window, values in the
    message, bytes in hand): that size is what its shape needs."""
    if isinstance(data, bytes):
        nbytes: int | None = len(data)
        declared = False
    else:
        nbytes = data.nbytes
        declared = data.declared
    if nbytes is not None and nbytes != count * dtype.itemsize:
        size = "is declared as" if declared else "data is"
        raise InvalidInput(
            f"{name} {size} {nbytes} bytes, but shape {list(shape)} of "
            f"{dtype.name} needs {count * dtype.itemsize}"
        )


async def _taken(data: bytes | Unread) -> bytes:
    return data if isinstance(data, bytes) else await data.read()


def in_hand(data: bytes | Unread | None) -> bytes:
    if not isinstance(data, bytes):
        raise Internal("this is a bug: an input was validated before it was read")
    return data


def check_data_size(
    name: str, data: bytes, shape: tuple[int, ...], dtype: DType, tokens: int
) -> None:
    expected_bytes = tokens * dtype.itemsize
    if len(data) != expected_bytes:
        raise InvalidInput(
            f"{name} data is {len(data)} bytes, but shape {list(shape)} of "
            f"{dtype.name} needs {expected_bytes}"
        )
