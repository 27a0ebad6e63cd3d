"""User input to EmbedRequest (replies to arrays: ``decode.py``).

Input forms accepted by :func:`encode_ids`:

- a numpy array ``[B,S]`` or ``[S]`` (one sequence, sent as ``[1,S]``). int64 and int32
  travel as they are; other integer dtypes are converted when that is lossless (int8,
  int16, uint8, uint16 to int32; uint32 and uint64 to int64, the latter only if every
  value fits); floats, bools and anything else are refused;
- anything with ``__array__`` (a CPU torch tensor, for example; torch is never imported);
- a list (or tuple) of ints: one sequence;
- a list of lists (or of 1-D arrays): rectangular becomes ``[B,S]``; ragged (lengths
  differ) becomes flat ids ``[N]`` plus ``lengths [B]``, no padding on the wire.

Sequence-first (``sequence_first=True``): a 2-D array is ``[S,B]`` (a 1-D one, one
sequence, is sent as ``[S,1]``), and the answer is ``[S,B,D]``; a list of lists is still a
list of sequences, one per batch entry: rectangular, sent as ``[S,B]``; ragged, as flat ids
and lengths, answered ``[S_max,B,D]``. A flat answer ``[N,D]`` has no batch axis, so it is
refused sequence-first.

Ids are checked against the vocabulary by the server, which knows V; the client refuses
only what cannot become a valid request at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt

from tokembed.client import dtypes
from tokembed.client.errors import InvalidInputError, client_invalid_input
from tokembed.v1 import embedding_pb2 as pb

Layout = Literal["padded", "flat"]
OutputDType: TypeAlias = dtypes.OutputName

_LAYOUTS: dict[str, pb.RaggedLayout.ValueType] = {
    "padded": pb.RAGGED_LAYOUT_PADDED,
    "flat": pb.RAGGED_LAYOUT_FLAT,
}
_INT64: np.dtype[np.signedinteger[Any]] = dtypes.INT64.numpy
_INT32: np.dtype[np.signedinteger[Any]] = dtypes.INT32.numpy
_INT64_MAX = int(np.iinfo(np.int64).max)
_INT64_MIN = int(np.iinfo(np.int64).min)


@dataclass(frozen=True)
class EncodedIds:
    """Validated ids, ready for the wire.

    ``ids`` is int32 or int64, little-endian, C-contiguous: ``[B,S]`` when ``lengths`` is
    None, else ``[N]`` flat with ``lengths [B]`` (every length >= 1, summing to N).
    """

    ids: npt.NDArray[np.signedinteger[Any]]
    lengths: npt.NDArray[np.int64] | None
    # Rectangular ids are [S,B] and the answer [S,B,D] ([S_max,B,D] for ragged ids).
    sequence_first: bool = False

    @property
    def batch_size(self) -> int:
        if self.lengths is not None:
            return len(self.lengths)
        return int(self.ids.shape[1 if self.sequence_first else 0])

    @property
    def num_tokens(self) -> int:
        return int(self.ids.size)

    @property
    def max_length(self) -> int:
        if self.lengths is not None:
            return int(self.lengths.max())
        return int(self.ids.shape[0 if self.sequence_first else 1])

    def output_rows(self, layout: Layout) -> int:
        """How many D-wide rows the answer has, padding included."""
        if layout == "flat":
            return self.num_tokens
        return self.batch_size * self.max_length

    def leading_shape(self, layout: Layout) -> tuple[int, ...]:
        """The answer's shape without D: ``(B, S)``, ``(B, S_max)`` or ``(N,)`` for flat;
        sequence-first, ``(S, B)`` or ``(S_max, B)``."""
        if layout == "flat":
            return (self.num_tokens,)
        if self.sequence_first:
            return (self.max_length, self.batch_size)
        return (self.batch_size, self.max_length)


class EmbedCall(NamedTuple):
    """One Embed call, ready to send: its request bytes and what the answer must be."""

    request: bytes  # the EmbedRequest's wire bytes
    leading_shape: tuple[int, ...]  # the answer's shape without D
    output_rows: int  # D-wide rows in the answer, padding included
    output_itemsize: int  # bytes per value of the answer
    sequence_first: bool = False  # the answer is [S,B,D] ([S_max,B,D])


def embed_call(
    ids: Any,
    dtype: Any,
    layout: str,
    *,
    model_name: str = "",
    request_id: str = "",
    sequence_first: bool = False,
    token_types: Any = None,
) -> EmbedCall:
    """Validate and encode one Embed call's input (raises InvalidInputError).
    ``token_types``: a segment model's token type ids, in any form ``ids`` takes and of
    the same shape (or the same sequence lengths), in the same order as the ids
    (``sequence_first`` too); None: every type is 0."""
    checked_layout = check_layout(layout, sequence_first)
    answer_dtype = output_dtype(dtype)  # resolved once: encode_request takes its name
    encoded = encode_ids(ids, sequence_first=sequence_first)
    types = None if token_types is None else encode_token_types(token_types, encoded)
    request = encode_request(
        encoded,
        dtype=answer_dtype.name,
        layout=checked_layout,
        model_name=model_name,
        request_id=request_id,
        token_types=types,
    )
    return EmbedCall(
        request,
        encoded.leading_shape(checked_layout),
        encoded.output_rows(checked_layout),
        answer_dtype.itemsize,
        sequence_first,
    )


def encode_ids(ids: Any, *, sequence_first: bool = False) -> EncodedIds:
    """Turn any accepted input form (see the module docstring) into :class:`EncodedIds`."""
    if isinstance(ids, np.ndarray):
        return _from_array(ids, sequence_first)
    if isinstance(ids, (str, bytes, bytearray)):
        raise client_invalid_input(
            f"ids must be integers (an array or a list of lists), got {type(ids).__name__}"
        )
    if isinstance(ids, Sequence):
        return _from_sequence(ids, sequence_first)
    if hasattr(ids, "__array__"):
        return _from_array(_asarray(ids, "ids"), sequence_first)
    raise client_invalid_input(
        "ids must be a numpy array, a list of ints, a list of lists of ints or an object "
        f"with __array__, got {type(ids).__name__}"
    )


def encode_token_types(token_types: Any, ids: EncodedIds) -> EncodedIds:
    """Token type ids encoded as ids are, refused unless they have the ids' shape (one
    type per id). Whether each is below the model's T is the server's to say."""
    try:
        types = encode_ids(token_types, sequence_first=ids.sequence_first)
    except InvalidInputError as exc:
        raise client_invalid_input(f"token_types: {exc}") from None
    if types.ids.shape != ids.ids.shape or not _same_lengths(types.lengths, ids.lengths):
        raise client_invalid_input(
            f"token_types must have the ids' shape (one type per id): ids are "
            f"{_shape_text(ids)}, token_types {_shape_text(types)}"
        )
    return types


def _same_lengths(a: npt.NDArray[np.int64] | None, b: npt.NDArray[np.int64] | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(np.array_equal(a, b))


def _shape_text(encoded: EncodedIds) -> str:
    if encoded.lengths is None:
        return str(list(encoded.ids.shape))
    return f"sequences of lengths {encoded.lengths.tolist()}"


def _asarray(obj: Any, what: str) -> npt.NDArray[Any]:
    if isinstance(obj, (list, tuple)):
        # Python ints past int64 would become objects or floats in numpy: name them here.
        for index, value in enumerate(obj):
            if isinstance(value, (str, bytes)):
                raise client_invalid_input(f"{what}: element {index} = {value!r} is not an id")
            if isinstance(value, int) and not _INT64_MIN <= value <= _INT64_MAX:
                raise client_invalid_input(
                    f"{what}: element {index} = {value} does not fit in int64"
                )
    try:
        return np.asarray(obj)
    except (TypeError, ValueError, OverflowError) as exc:
        raise client_invalid_input(f"{what} cannot be read as an array of ids: {exc}") from exc


def _is_row(item: Any) -> bool:
    if isinstance(item, (list, tuple)):
        return True
    return (isinstance(item, np.ndarray) or hasattr(item, "__array__")) and np.ndim(item) >= 1


def _from_sequence(seq: Sequence[Any], sequence_first: bool) -> EncodedIds:
    if len(seq) == 0:
        raise client_invalid_input("ids are empty: give at least one sequence of ids")
    if not _is_row(seq[0]):
        return _from_array(_asarray(seq, "ids"), sequence_first)  # a flat list: one sequence
    rectangle = _rectangle(seq)
    if rectangle is not None:
        ids = _int_ids(rectangle, "ids")
        if sequence_first:  # a list of sequences, sent [S,B]
            return EncodedIds(np.ascontiguousarray(ids.T), None, True)
        return EncodedIds(np.ascontiguousarray(ids), None)
    rows: list[npt.NDArray[np.signedinteger[Any]]] = []
    for i, item in enumerate(seq):
        if not _is_row(item):
            raise client_invalid_input(
                f"ids mix sequences and single ids: element {i} is {item!r}, not a sequence"
            )
        row = _asarray(item, f"sequence {i}")
        if row.ndim != 1:
            raise client_invalid_input(
                f"sequence {i} has shape {row.shape}; each sequence must be a flat list of ids"
            )
        if row.size == 0:
            raise client_invalid_input(
                f"sequence {i} is empty; every sequence needs at least one id"
            )
        rows.append(_int_ids(row, f"sequence {i}"))
    lengths = np.array([r.size for r in rows], dtype=np.int64)
    if len({r.dtype for r in rows}) > 1:
        rows = [r.astype("<i8") for r in rows]
    if bool((lengths == lengths[0]).all()):
        if sequence_first:  # a list of sequences, sent [S,B]
            return EncodedIds(np.ascontiguousarray(np.stack(rows, axis=1)), None, True)
        return EncodedIds(np.stack(rows), None)
    return EncodedIds(np.concatenate(rows), lengths, sequence_first)


def _rectangle(seq: Sequence[Any]) -> npt.NDArray[Any] | None:
    """Lists of ids of one length, read by numpy in one call as ``[B, S]`` integers; None
    for anything else (ragged, empty, not integers, arrays...), which is read a sequence at
    a time, so that what is wrong is named with its sequence. A list that starts with a
    bool is left to that path too: numpy would read a sequence of bools beside one of ints
    as ints, where alone it is refused."""
    if not all(
        isinstance(row, (list, tuple)) and row and not isinstance(row[0], (bool, np.bool_))
        for row in seq
    ):
        return None
    try:
        array = np.asarray(seq)
    except (TypeError, ValueError, OverflowError):
        return None
    if array.ndim != 2 or array.shape[1] == 0 or array.dtype.kind not in "iu":
        return None
    # uint64: a value past int64 (numpy 1.x reads Python ints up to 2**64 - 1 so), named
    # with its sequence below.
    return None if array.dtype == np.uint64 else array


def _from_array(arr: npt.NDArray[Any], sequence_first: bool = False) -> EncodedIds:
    if arr.ndim == 0:
        raise client_invalid_input(
            "ids must be [B,S] or [S], got a single number; wrap it in a list"
        )
    if arr.ndim > 2:
        axes = "[S,B]" if sequence_first else "[B,S]"
        raise client_invalid_input(f"ids must be {axes} or [S], got shape {tuple(arr.shape)}")
    if arr.size == 0:
        raise client_invalid_input(f"ids are empty (shape {tuple(arr.shape)})")
    ids = _int_ids(arr, "ids")
    if ids.ndim == 1:  # one sequence: [1,S], or sequence-first [S,1]
        ids = ids.reshape(-1, 1) if sequence_first else ids.reshape(1, -1)
    return EncodedIds(np.ascontiguousarray(ids), None, sequence_first)


def _int_ids(arr: npt.NDArray[Any], what: str) -> npt.NDArray[np.signedinteger[Any]]:
    """int32/int64 little-endian, converting other integer dtypes only when lossless."""
    kind, size = arr.dtype.kind, arr.dtype.itemsize
    if kind == "O":
        # Python ints beyond int64 (numpy keeps them as objects), or things not numbers.
        raise client_invalid_input(_first_bad_object(arr, what))
    if kind not in "iu":
        hint = ""
        if kind == "f":
            hint = " (if the values are whole numbers, convert them: ids.astype(np.int64))"
        raise client_invalid_input(f"{what} must be integers, got dtype {arr.dtype}{hint}")
    if kind == "i" and size == 8:
        target = _INT64
    elif (size == 4 and kind == "i") or size <= 2:  # int32, or what widens to it losslessly
        target = _INT32
    else:  # uint32 and uint64 need int64; uint64 only if every value fits
        target = _INT64
        if kind == "u" and size == 8 and arr.size and int(arr.max()) > _INT64_MAX:
            raise client_invalid_input(
                f"{what} holds {int(arr.max())}, which does not fit in int64"
            )
    if arr.dtype == target:
        return arr
    return arr.astype(target)


def _first_bad_object(arr: npt.NDArray[Any], what: str) -> str:
    """The message for an object array of ids: its first value that is no int64, named."""
    for index, value in np.ndenumerate(arr):
        where = f"{what}: element {index[0] if len(index) == 1 else index}"
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            return f"{where} = {value!r} is not an integer id"
        if not _INT64_MIN <= int(value) <= _INT64_MAX:
            return f"{where} = {int(value)} does not fit in int64"
    return f"{what} must be integers, got dtype {arr.dtype}"  # pragma: no cover - a bug


def output_dtype(dtype: Any) -> dtypes.DType:
    """The answer dtype asked for by name ("float32", "float16", "bfloat16") or numpy type
    (``ml_dtypes.bfloat16`` for bfloat16)."""
    if isinstance(dtype, str) and dtype in dtypes.OUTPUT:
        return dtypes.OUTPUT[dtype]  # the common case, without building a numpy dtype
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    row = dtypes.OUTPUT.get(name)
    if row is None:
        *others, last = dtypes.OUTPUT
        raise client_invalid_input(
            f"output dtype must be {', '.join(others)} or {last}, got {dtype!r}"
        )
    return row


def output_dtype_code(dtype: Any) -> pb.DType.ValueType:
    """The wire DType of the answer dtype asked for (see ``output_dtype``)."""
    return output_dtype(dtype).wire


def check_layout(layout: str, sequence_first: bool = False) -> Layout:
    if layout not in _LAYOUTS:
        raise client_invalid_input(f"layout must be 'padded' or 'flat', got {layout!r}")
    if layout == "flat" and sequence_first:
        raise client_invalid_input(
            "layout 'flat' answers [N,D], which has no batch axis to put second: "
            "sequence-first answers are [S,B,D] (padded, for ragged ids)"
        )
    return "flat" if layout == "flat" else "padded"


def encode_request(
    encoded: EncodedIds,
    *,
    dtype: Any = "float32",
    layout: str = "padded",
    model_name: str = "",
    request_id: str = "",
    token_types: EncodedIds | None = None,
) -> bytes:
    """The EmbedRequest's wire bytes for validated ids (and token types of their shape,
    from ``encode_token_types``), written by the generated classes.

    (Writing them by hand, with the frames of calls of a shape seen before cached,
    measured within noise of this in an A/B of tiny calls in turns.) With
    ``layout="flat"`` rectangular input is sent as flat ids plus equal lengths, so a flat
    answer is always ``[N,D]`` whatever the input's shape.
    """
    layout = check_layout(layout, encoded.sequence_first)
    ids, lengths = encoded.ids, encoded.lengths
    types = None if token_types is None else token_types.ids
    if layout == "flat" and lengths is None:
        lengths = np.full(ids.shape[0], ids.shape[1], dtype=np.int64)
        ids = ids.reshape(-1)
        types = None if types is None else types.reshape(-1)
    request = pb.EmbedRequest(
        input_ids=_tensor(ids),
        output_dtype=output_dtype_code(dtype),
        model_name=_checked_text(model_name, "model_name"),
        request_id=_checked_text(request_id, "request_id"),
    )
    if lengths is not None:
        request.lengths.extend(lengths.tolist())
        request.ragged_layout = _LAYOUTS[layout]
    if types is not None:
        request.token_type_ids.CopyFrom(_tensor(types))
    if encoded.sequence_first:
        request.layout = pb.LAYOUT_SEQUENCE_FIRST
    return request.SerializeToString()


def _tensor(ids: npt.NDArray[np.signedinteger[Any]]) -> pb.Tensor:
    return pb.Tensor(
        dtype=(dtypes.INT32 if ids.dtype.itemsize == 4 else dtypes.INT64).wire,
        shape=list(ids.shape),
        data=ids.tobytes(),  # C order whatever the array's strides
    )


def _checked_text(text: str, what: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise client_invalid_input(f"{what} {text!r} is not valid Unicode text: {exc}") from exc
    return text
