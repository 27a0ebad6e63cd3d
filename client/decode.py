"""Replies to numpy arrays, and the shape check against what was sent.

Large unary and stream replies are never copied: the array is a read-only
``np.frombuffer`` view of the bytes gRPC received (see ``_wire``); small ones are parsed
by protobuf's C parser, which is faster there. Chunked replies are assembled into one
preallocated array, each chunk copied into it once; that array is writable.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from tokembed.client import _wire, dtypes
from tokembed.client.errors import (
    EmbeddingError,
    from_status,
    protocol_error,
    status_code_from_number,
)
from tokembed.client.results import EmbedResult, NearestResult, Timings
from tokembed.v1 import embedding_pb2 as pb


def frombuffer(
    buf: bytes | memoryview, dtype: int, shape: Sequence[int], offset: int = 0, nbytes: int = -1
) -> npt.NDArray[Any]:
    """A view of ``buf[offset:offset+nbytes]`` as a tensor, checking that sizes agree."""
    # Few, cheap steps: this runs once per answer, and for a tiny answer it was the
    # client's largest cost (with a list of dims and any()).
    row = dtypes.BY_WIRE.get(dtype)
    if row is None:
        raise protocol_error(f"tensor dtype {dtypes.name_of(dtype)} is not a known dtype")
    np_dtype = row.numpy
    dims = tuple(shape)
    if dims and min(dims) < 0:
        raise protocol_error(f"tensor shape {list(dims)} has a negative dimension")
    count = math.prod(dims)
    if nbytes < 0:
        nbytes = len(buf) - offset
    if count * np_dtype.itemsize != nbytes:
        raise protocol_error(
            f"tensor of shape {list(dims)} and dtype {np_dtype.name} needs "
            f"{count * np_dtype.itemsize} bytes, got {nbytes}"
        )
    arr = np.frombuffer(buf, dtype=np_dtype, count=count, offset=offset).reshape(dims)
    if sys.byteorder != "little":  # the wire is little-endian; give native arrays
        arr = arr.astype(np_dtype.newbyteorder("="))
    return arr


def decode_tensor(tensor: pb.Tensor) -> npt.NDArray[Any]:
    """A parsed Tensor message to an array (reads ``tensor.data`` once)."""
    return frombuffer(tensor.data, tensor.dtype, tensor.shape)


def named_tensors(raw: bytes) -> tuple[dict[str, Any], pb.TensorsResponse]:
    """An answer of several named tensors (TensorsResponse: Nearest's, Tokenize's,
    EmbedText's): its tensors by name, as arrays, and the response around them (without
    its tensors when they were found in place)."""
    if len(raw) >= ZERO_COPY_MIN_BYTES:
        try:
            return _in_place(raw)
        except _wire.WireError:
            pass  # something unusual: protobuf's parse says what it is
    try:
        response = pb.TensorsResponse.FromString(raw)
    except Exception as exc:  # protobuf's DecodeError
        raise protocol_error(f"the answer is not a TensorsResponse: {exc}") from exc
    tensors = {item.name: decode_tensor(item.tensor) for item in response.tensors}
    return tensors, response


def _in_place(raw: bytes) -> tuple[dict[str, Any], pb.TensorsResponse]:
    """A large answer's tensors as read-only views of the received bytes (as ``decode``
    does for Embed: protobuf's parse would copy each tensor twice), the rest of the
    message parsed by protobuf."""
    tensors: dict[str, Any] = {}
    rest = []
    for field in _wire.fields(raw, 0, len(raw)):
        if field.number != 1:  # TensorsResponse.tensors
            rest.append(raw[field.start : field.end])
            continue
        if field.wire_type != _wire.WIRE_LEN:
            raise _wire.WireError("tensors is not length-delimited")
        inner = list(_wire.fields(raw, field.value_start, field.end))
        name_field = _wire.only(inner, 1)
        tensor_field = _wire.only(inner, 2)
        if tensor_field is None:
            raise _wire.WireError("a named tensor without its tensor")
        name = "" if name_field is None else raw[name_field.value_start : name_field.end].decode()
        parts = list(_wire.fields(raw, tensor_field.value_start, tensor_field.end))
        dtypes = [f for f in parts if f.number == 1 and f.wire_type == _wire.WIRE_VARINT]
        if len(dtypes) != 1:
            raise _wire.WireError("a tensor's dtype is missing or repeated")
        dtype, _ = _wire.read_varint(raw, dtypes[0].value_start, dtypes[0].end)
        shape_field, data_field = _wire.only(parts, 2), _wire.only(parts, 3)
        shape: list[int] = []
        if shape_field is not None:
            pos = shape_field.value_start
            while pos < shape_field.end:
                dim, pos = _wire.read_varint(raw, pos, shape_field.end)
                shape.append(dim)
        start = data_field.value_start if data_field is not None else 0
        size = data_field.end - start if data_field is not None else 0
        if name in tensors:
            raise _wire.WireError(f"tensor {name!r} given twice")
        tensors[name] = frombuffer(raw, dtype, shape, start, size)
    return tensors, pb.TensorsResponse.FromString(b"".join(rest))


def nearest_result(raw: bytes) -> NearestResult:
    """A Nearest answer's raw bytes to its result."""
    return nearest_result_of(*named_tensors(raw))


def nearest_result_of(tensors: dict[str, Any], response: pb.TensorsResponse) -> NearestResult:
    """A Nearest answer's tensors by name (from a TensorsResponse, or a NearestChunked
    reply reassembled) and the response around them, to its result."""
    missing = [name for name in ("ids", "scores") if name not in tensors]
    if missing:
        raise EmbeddingError(f"the server's Nearest answer has no {', '.join(missing)}")
    return NearestResult(
        ids=tensors["ids"], scores=tensors["scores"], logits=tensors.get("logits"),
        timings=Timings.from_proto(response.timings), model_name=response.model_name,
        model_version=response.model_version, request_id=response.request_id,
    )  # fmt: skip


def _result(header: pb.EmbedResponse, hidden_states: npt.NDArray[Any]) -> EmbedResult:
    return EmbedResult(
        hidden_states=hidden_states,
        lengths=np.array(header.lengths, dtype=np.int64) if header.lengths else None,
        timings=Timings.from_proto(header.timings),
        model_name=header.model_name,
        model_version=header.model_version,
        request_id=header.request_id,
    )


# Below this, protobuf's C parser (which copies the payload) beats finding the payload in
# Python (the two measured even around this size); far above it the copy dominates,
# while the zero-copy view costs the same at any size.
ZERO_COPY_MIN_BYTES = 256 * 1024


def decode_response(raw: bytes | pb.EmbedResponse) -> EmbedResult:
    """An EmbedResponse, as raw wire bytes (zero-copy when large) or a parsed message."""
    if isinstance(raw, pb.EmbedResponse):
        return _result(raw, decode_tensor(raw.hidden_states))
    if len(raw) < ZERO_COPY_MIN_BYTES:
        return decode_response(_parse_response(raw))
    return _decode_response_span(raw, 0, len(raw))


def decode_hidden_states(raw: bytes) -> npt.NDArray[Any]:
    """Only the array of an EmbedResponse's raw bytes, as :func:`decode_response` gives
    it, without the result around it: what ``embed`` returns, saving a tiny call the
    timings, lengths and result objects."""
    if len(raw) < ZERO_COPY_MIN_BYTES:
        return decode_tensor(_parse_response(raw).hidden_states)
    return _decode_response_span(raw, 0, len(raw)).hidden_states


def embed_answer(raw: bytes, leading: tuple[int, ...], itemsize: int) -> npt.NDArray[Any]:
    """What ``embed`` returns for an EmbedResponse's raw bytes: its array, as
    :func:`decode_hidden_states` gives it, checked against the request's leading shape
    (``itemsize``: the bytes per value asked for).

    Answers to requests of one shape begin with the same bytes (the tensor's field, dtype,
    shape and the data's length): once one answer has been decoded in full, the next that
    begins with its bytes is a view of its data at once, if nothing after the data holds
    the tensor field again (which protobuf would merge). Why: decoding a tiny answer in
    full is several times the cost of this way.
    """
    key = (leading, itemsize)
    known = _answer_heads.get(key)
    if known is not None and raw.startswith(known.head):
        array = known.array(raw)
        if array is not None:
            return array
    array = check_array_shape(decode_hidden_states(raw), leading)
    if len(_answer_heads) < _HEADS_CACHED or key in _answer_heads:
        head = _AnswerHead.of(array)
        if head is not None:
            _answer_heads[key] = head
    return array


class _AnswerHead(NamedTuple):
    """The bytes an EmbedResponse begins with, up to its tensor's data, for answers of one
    shape and dtype; and that shape and dtype."""

    head: bytes
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    values: int  # in the array

    @staticmethod
    def of(array: npt.NDArray[Any]) -> _AnswerHead | None:
        """The head protobuf writes before ``array``'s data (None: none is learnt here)."""
        # By the type's name: the arrays learnt from are native (little-endian here).
        row = dtypes.OUTPUT.get(array.dtype.name)
        if row is None or sys.byteorder != "little":
            return None
        code = row.wire
        dims = b"".join([_wire.write_varint(d) for d in array.shape])
        tensor_head = b"".join([
            b"\x08", _wire.write_varint(code),  # Tensor.dtype
            b"\x12", _wire.write_varint(len(dims)), dims,  # Tensor.shape, packed
            b"\x1a", _wire.write_varint(array.nbytes),  # Tensor.data's key and length
        ])  # fmt: skip
        size = len(tensor_head) + array.nbytes
        head = b"".join([b"\x0a", _wire.write_varint(size), tensor_head])  # hidden_states
        return _AnswerHead(head, array.shape, array.dtype, array.size)

    def array(self, raw: bytes) -> npt.NDArray[Any] | None:
        """The answer's array, a view of ``raw``; None if ``raw`` is shorter than the data,
        or the rest holds the tensor field again, or does not parse: the full decode then
        says what it means."""
        start = len(self.head)
        end = start + self.values * self.dtype.itemsize
        if len(raw) < end:  # cut short: the full decode names the fault
            return None
        try:
            rest = pb.EmbedResponse.FromString(raw[end:])
        except Exception:
            return None
        if rest.HasField("hidden_states"):
            return None
        return np.frombuffer(raw, dtype=self.dtype, count=self.values, offset=start).reshape(
            self.shape
        )


# Answer heads by (leading shape, itemsize); a caller of endless shapes gets no more.
_HEADS_CACHED = 1024
_answer_heads: dict[tuple[tuple[int, ...], int], _AnswerHead] = {}


def _parse_response(raw: bytes) -> pb.EmbedResponse:
    try:
        return pb.EmbedResponse.FromString(raw)
    except Exception as exc:
        raise protocol_error(f"cannot parse EmbedResponse: {exc}") from exc


def _decode_response_span(raw: bytes, start: int, end: int) -> EmbedResult:
    try:
        outer = list(_wire.fields(raw, start, end))
        hs = _wire.only(outer, 1)
        inner = list(_wire.fields(raw, hs.value_start, hs.end)) if hs else []
        data = _wire.only(inner, 3)
    except _wire.WireError:
        # Leave the unusual encodings to protobuf (it parses, and copies, the payload).
        try:
            msg = pb.EmbedResponse.FromString(raw[start:end])
        except Exception as exc:
            raise protocol_error(f"cannot parse EmbedResponse: {exc}") from exc
        return decode_response(msg)
    try:
        header = pb.EmbedResponse.FromString(_wire.without(raw, start, end, hs))
        if hs is not None:
            header.hidden_states.ParseFromString(_wire.without(raw, hs.value_start, hs.end, data))
    except Exception as exc:
        raise protocol_error(f"cannot parse EmbedResponse: {exc}") from exc
    tensor = header.hidden_states
    if data is None:
        return _result(header, frombuffer(b"", tensor.dtype, tensor.shape))
    array = frombuffer(
        raw, tensor.dtype, tensor.shape, offset=data.value_start, nbytes=data.end - data.value_start
    )
    return _result(header, array)


def decode_stream_response(raw: bytes | pb.EmbedStreamResponse) -> EmbedResult | EmbeddingError:
    """One EmbedStream answer: the result, or the typed error for that request."""
    if not isinstance(raw, pb.EmbedStreamResponse):
        try:
            found = list(_wire.fields(raw, 0, len(raw)))
            response = _wire.only(found, 1)
            if response is not None and not any(f.number == 2 for f in found):
                return _decode_response_span(raw, response.value_start, response.end)
        except _wire.WireError:
            pass
        try:
            raw = pb.EmbedStreamResponse.FromString(raw)
        except Exception as exc:
            raise protocol_error(f"cannot parse EmbedStreamResponse: {exc}") from exc
    kind = raw.WhichOneof("result")
    if kind == "response":
        return decode_response(raw.response)
    if kind == "error":
        # A server older than Error.reason sends none: the (code, None) row then applies.
        reason = raw.error.reason or None
        return from_status(status_code_from_number(raw.error.code), reason, raw.error.message)
    raise protocol_error("an EmbedStream answer holds neither a response nor an error")


class ChunkAssembler:
    """Reassembles an EmbedChunked reply into one preallocated array.

    Feed every message to :meth:`add` (raw bytes or parsed EmbedChunk), then call
    :meth:`result`. The first message must carry the header; each chunk's bytes are
    copied once, into place; the sizes must add up exactly.
    """

    def __init__(self) -> None:
        self._header: pb.EmbedResponse | None = None
        self._buffer: npt.NDArray[np.uint8] | None = None
        self._filled = 0

    def add(self, chunk: bytes | pb.EmbedChunk) -> None:
        header, data = self._split(chunk)
        if header is not None:
            if self._header is not None:
                raise protocol_error("EmbedChunked sent a second header")
            self._start(header)
        if len(data) == 0:
            return
        if self._buffer is None:
            raise protocol_error("EmbedChunked sent data before its header")
        end = self._filled + len(data)
        if end > self._buffer.size:
            raise protocol_error(
                f"EmbedChunked sent more than the {self._buffer.size} bytes its header announced"
            )
        self._buffer[self._filled : end] = np.frombuffer(data, dtype=np.uint8)
        self._filled = end

    def result(self) -> EmbedResult:
        if self._header is None or self._buffer is None:
            raise protocol_error("EmbedChunked ended without a header")
        if self._filled != self._buffer.size:
            raise protocol_error(
                f"EmbedChunked ended after {self._filled} of {self._buffer.size} bytes"
            )
        tensor = self._header.hidden_states
        return _result(self._header, frombuffer(self._buffer.data, tensor.dtype, tensor.shape))

    def _start(self, header: pb.EmbedResponse) -> None:
        tensor = header.hidden_states
        if tensor.data:
            raise protocol_error("the EmbedChunked header must not carry data")
        row = dtypes.BY_WIRE.get(tensor.dtype)
        if row is None or any(d < 0 for d in tensor.shape):
            raise protocol_error(
                f"EmbedChunked header has dtype {dtypes.name_of(tensor.dtype)}, "
                f"shape {list(tensor.shape)}"
            )
        self._header = header
        self._buffer = np.empty(math.prod(tensor.shape) * row.itemsize, dtype=np.uint8)

    @staticmethod
    def _split(chunk: bytes | pb.EmbedChunk) -> tuple[pb.EmbedResponse | None, bytes | memoryview]:
        return _split_chunk(chunk, pb.EmbedChunk, pb.EmbedResponse)


class TensorsChunkAssembler:
    """Reassembles a reply of ``TensorsChunk`` messages (``method``'s: NearestChunked,
    EmbedTextChunked) into one preallocated array per tensor, as :class:`ChunkAssembler`
    does for EmbedChunked.

    The header names every tensor, its dtype and shape (no data); the slices after it are
    the tensors' bytes, each tensor's after the one before it, and a slice may span the
    end of one and the start of the next. Each byte is copied once, into its tensor's
    array; the sizes must add up exactly. The arrays are writable.
    """

    def __init__(self, method: str = "NearestChunked") -> None:
        self._method = method
        self._header: pb.TensorsResponse | None = None
        self._names: list[str] = []
        self._buffers: list[npt.NDArray[np.uint8]] = []
        self._arrays: dict[str, npt.NDArray[Any]] = {}
        self._current = 0  # the tensor being filled
        self._filled = 0  # bytes of it so far
        self._total = 0
        self._received = 0

    def add(self, chunk: bytes | pb.TensorsChunk) -> None:
        header, data = self._split(chunk)
        if header is not None:
            if self._header is not None:
                raise protocol_error(f"{self._method} sent a second header")
            self._start(header)
        if len(data) == 0:
            return
        if self._header is None:
            raise protocol_error(f"{self._method} sent data before its header")
        if self._received + len(data) > self._total:
            raise protocol_error(
                f"{self._method} sent more than the {self._total} bytes its header announced"
            )
        view = np.frombuffer(data, dtype=np.uint8)
        while view.size:
            buffer = self._buffers[self._current]
            room = buffer.size - self._filled
            if room == 0:
                self._current, self._filled = self._current + 1, 0
                continue
            taken = min(room, view.size)
            buffer[self._filled : self._filled + taken] = view[:taken]
            self._filled += taken
            view = view[taken:]
        self._received += len(data)

    def result(self) -> tuple[dict[str, Any], pb.TensorsResponse]:
        """The tensors by name and the header around them."""
        if self._header is None:
            raise protocol_error(f"{self._method} ended without a header")
        if self._received != self._total:
            raise protocol_error(
                f"{self._method} ended after {self._received} of {self._total} bytes"
            )
        return self._arrays, self._header

    def _start(self, header: pb.TensorsResponse) -> None:
        for item in header.tensors:
            tensor = item.tensor
            if tensor.data:
                raise protocol_error(f"the {self._method} header must not carry data")
            row = dtypes.BY_WIRE.get(tensor.dtype)
            if row is None or any(d < 0 for d in tensor.shape):
                raise protocol_error(
                    f"{self._method} header has tensor {item.name!r} of dtype "
                    f"{dtypes.name_of(tensor.dtype)}, shape {list(tensor.shape)}"
                )
            if item.name in self._arrays:
                raise protocol_error(f"{self._method} header names tensor {item.name!r} twice")
            array = np.empty(tuple(tensor.shape), dtype=row.numpy)
            self._arrays[item.name] = array
            self._buffers.append(array.reshape(-1).view(np.uint8))
            self._total += array.nbytes
        self._header = header

    @staticmethod
    def _split(
        chunk: bytes | pb.TensorsChunk,
    ) -> tuple[pb.TensorsResponse | None, bytes | memoryview]:
        return _split_chunk(chunk, pb.TensorsChunk, pb.TensorsResponse)


def _split_chunk(
    chunk: Any, chunk_type: type[Any], header_type: type[Any]
) -> tuple[Any, bytes | memoryview]:
    """A chunk message's header (only the first has one) and its data: read off the wire
    when it comes as raw bytes (the data a view of them, not a copy), else from the
    parsed ``chunk_type`` message, whose header is a ``header_type``."""
    name = chunk_type.DESCRIPTOR.name
    if isinstance(chunk, chunk_type):
        return (chunk.header if chunk.HasField("header") else None), chunk.data
    try:
        found = list(_wire.fields(chunk, 0, len(chunk)))
        header_field = _wire.only(found, 1)
        data_field = _wire.only(found, 2)
    except _wire.WireError:
        try:
            message = chunk_type.FromString(chunk)
        except Exception as exc:
            raise protocol_error(f"cannot parse {name}: {exc}") from exc
        return _split_chunk(message, chunk_type, header_type)
    header = None
    if header_field is not None:
        try:
            header = header_type.FromString(chunk[header_field.value_start : header_field.end])
        except Exception as exc:
            raise protocol_error(f"cannot parse {name} header: {exc}") from exc
    if data_field is None:
        return header, b""
    return header, memoryview(chunk)[data_field.value_start : data_field.end]


def check_shape(
    result: EmbedResult, leading: tuple[int, ...], sequence_first: bool = False
) -> EmbedResult:
    """Refuse an answer whose shape does not fit the request (a server bug); the result,
    marked sequence-first if the request was."""
    check_array_shape(result.hidden_states, leading)
    return dataclasses.replace(result, sequence_first=True) if sequence_first else result


def check_array_shape(array: npt.NDArray[Any], leading: tuple[int, ...]) -> npt.NDArray[Any]:
    """As :func:`check_shape`, for the array alone."""
    shape = array.shape
    if len(shape) != len(leading) + 1 or tuple(shape[:-1]) != leading:
        raise protocol_error(f"answer has shape {tuple(shape)} for a request of {leading} + [D]")
    return array
