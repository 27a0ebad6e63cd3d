"""Protobuf <-> domain, and the response bytes, encoded by hand around the tensor.

Building an ``EmbedResponse`` message and serialising it copies the tensor twice (into
the message, then into the wire bytes). Writing the few header bytes ourselves and
joining them with the array's buffer copies it once. The bytes are standard protobuf
wire format: any protobuf client parses them (tests/server/test_wire.py proves it
against the generated classes).
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from google.protobuf.message import DecodeError

from tokembed.server import inplace_bytes
from tokembed.server.domain import FLAT, PADDED, EmbedInput, EmbedOutput, Timings
from tokembed.server.errors import InvalidInput
from tokembed.v1 import embedding_pb2 as pb

if TYPE_CHECKING:
    from tokembed.server.service import ServedModel
    from tokembed.server.settings import Settings

_ID_DTYPE_NAMES = {pb.DTYPE_INT64: "int64", pb.DTYPE_INT32: "int32"}
_OUTPUT_DTYPE_NAMES = {
    pb.DTYPE_UNSPECIFIED: "float32",
    pb.DTYPE_FLOAT32: "float32",
    pb.DTYPE_FLOAT16: "float16",
}
_LAYOUT_NAMES = {
    pb.RAGGED_LAYOUT_UNSPECIFIED: PADDED,
    pb.RAGGED_LAYOUT_PADDED: PADDED,
    pb.RAGGED_LAYOUT_FLAT: FLAT,
}
_WIRE_DTYPES = {np.dtype("float32"): pb.DTYPE_FLOAT32, np.dtype("float16"): pb.DTYPE_FLOAT16}

_LEN = 2  # protobuf wire types: length-delimited, varint, 64-bit
_VARINT = 0
_I64 = 1


def _enum_name(enum: object, value: int) -> str:
    try:
        return str(enum.Name(value))  # type: ignore[attr-defined]
    except ValueError:
        return f"{value} (unknown {enum.DESCRIPTOR.name} value)"  # type: ignore[attr-defined]


@dataclass(frozen=True)
class MalformedRequest:
    """Request bytes that are not an ``EmbedRequest``.

    A deserializer that raises makes gRPC answer UNKNOWN on its own, past our status
    table and metrics; parsing never fails here instead, and ``to_domain`` turns this
    into INVALID_ARGUMENT like any other bad input (inside a stream: one error answer).
    """

    error: str
    request_id: str = ""


ParsedRequest = pb.EmbedRequest | MalformedRequest


def parse_request(data: bytes) -> ParsedRequest:
    """The deserializer of the Embed methods."""
    try:
        return pb.EmbedRequest.FromString(data)
    except DecodeError as exc:
        return MalformedRequest(str(exc))


def parse_model_info_request(data: bytes) -> pb.GetModelInfoRequest | None:
    """The deserializer of GetModelInfo. None for bytes that do not parse: answered
    INVALID_ARGUMENT (a raising deserializer would make gRPC answer UNKNOWN, past our
    status table)."""
    try:
        return pb.GetModelInfoRequest.FromString(data)
    except DecodeError:
        return None


def serialize_response(response: bytes | pb.ModelInfo) -> bytes:
    """The serializer of every method: answers already encoded pass through."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def to_domain(request: ParsedRequest) -> EmbedInput:
    if isinstance(request, MalformedRequest):
        raise InvalidInput(f"the request is not a valid tokembed.v1.EmbedRequest: {request.error}")
    tensor = request.input_ids
    return EmbedInput(
        ids_dtype=_ID_DTYPE_NAMES.get(tensor.dtype) or _enum_name(pb.DType, tensor.dtype),
        shape=tuple(tensor.shape),
        data=tensor.data,
        lengths=tuple(request.lengths),
        output_dtype=(
            _OUTPUT_DTYPE_NAMES.get(request.output_dtype)
            or _enum_name(pb.DType, request.output_dtype)
        ),
        layout=(
            _LAYOUT_NAMES.get(request.ragged_layout)
            or _enum_name(pb.RaggedLayout, request.ragged_layout)
        ),
        model_name=request.model_name,
        request_id=request.request_id,
    )


def model_info(info: ServedModel, settings: Settings) -> pb.ModelInfo:
    """GetModelInfo's answer: the served model and the limits a caller must respect."""
    manifest = info.model.manifest
    answer = pb.ModelInfo(
        name=manifest.name,
        version=manifest.version,
        vocab_size=manifest.vocab_size,
        d_model=manifest.d_model,
        scale=manifest.scale,
        weight_dtype=manifest.weight_dtype,
        input_dtypes=[pb.DTYPE_INT64, pb.DTYPE_INT32],
        output_dtypes=[pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16],
        execution_provider=info.execution_provider,
        limits=pb.Limits(
            max_tokens_per_request=settings.max_tokens_per_request,
            max_output_bytes_per_request=settings.max_output_bytes_per_request,
            max_batch_tokens=settings.max_batch_tokens,
            max_message_bytes=settings.max_message_bytes,
            max_delay_seconds=settings.max_delay_s,
        ),
        model_sha256=info.model.model_sha256,
    )
    if manifest.padding_idx is not None:
        answer.padding_id = manifest.padding_idx
    return answer


def plain_ids(request: ParsedRequest) -> tuple[bytes, int, int] | None:
    """``(ids bytes, B, S)`` of the commonest request, for ``EmbeddingService.embed_plain``:
    int64 ids of shape [B, S] (both > 0), no lengths, a float32 answer, no model name.
    None for any other request, which goes the general way (``to_domain``)."""
    if (
        isinstance(request, MalformedRequest)
        or request.lengths
        or request.model_name
        or request.output_dtype not in _FLOAT32_CODES
    ):
        return None
    tensor = request.input_ids
    if tensor.dtype != pb.DTYPE_INT64:
        return None
    shape = tensor.shape
    if len(shape) != 2 or shape[0] <= 0 or shape[1] <= 0:
        return None
    return tensor.data, shape[0], shape[1]


_FLOAT32_CODES = (pb.DTYPE_UNSPECIFIED, pb.DTYPE_FLOAT32)


def varint(value: int) -> bytes:
    if value < 0:
        raise ValueError(f"this is a bug: varint of negative {value}")
    if value < _SMALL_VARINTS_LIMIT:
        return _SMALL_VARINTS[value]
    return _encode_varint(value)


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


# Shapes, tags and small lengths are almost always below 2**14: look them up, don't build
# them (about 11 varints per response; building each costs ~1.5 us in Python).
_SMALL_VARINTS_LIMIT = 1 << 14
_SMALL_VARINTS = tuple(_encode_varint(value) for value in range(_SMALL_VARINTS_LIMIT))


def _key(field_number: int, wire_type: int) -> bytes:
    return varint(field_number << 3 | wire_type)


def _tensor_fields(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """A Tensor message's dtype and shape fields."""
    packed_shape = b"".join([varint(int(dim)) for dim in shape])
    return b"".join([
        _key(1, _VARINT), varint(_WIRE_DTYPES[dtype]),
        _key(2, _LEN), varint(len(packed_shape)), packed_shape,
    ])  # fmt: skip


def _response_prefix(shape: tuple[int, ...], dtype: np.dtype, nbytes: int) -> bytes:
    """An EmbedResponse up to its tensor's data: the tensor field's key and length, the
    Tensor's dtype and shape, and its data field's key and length.

    Cached by shape and dtype (which fix ``nbytes``): building one is a dozen small
    steps, ~2 us in a hot loop and several times that live, about a tenth of a tiny
    request's handler; callers send few distinct shapes.
    """
    key = (shape, dtype.str)  # "<f4": the byte order too
    prefix = _prefixes.get(key)
    if prefix is None:
        tensor_header = b"".join([_tensor_fields(shape, dtype), _key(3, _LEN), varint(nbytes)])
        prefix = b"".join([_key(1, _LEN), varint(len(tensor_header) + nbytes), tensor_header])
        if len(_prefixes) < _PREFIXES_CACHED:  # a caller of endless shapes gets no more
            _prefixes[key] = prefix
    return prefix


_PREFIXES_CACHED = 4096
_prefixes: dict[tuple[tuple[int, ...], str], bytes] = {}


def response_metadata(
    output: EmbedOutput, model_name: str, model_version: str, request_id: str, server_s: float
) -> bytes:
    """Every field of the ``EmbedResponse`` but the tensor, as wire bytes (see
    :func:`answer_metadata`)."""
    return answer_metadata(
        output.timings, output.lengths, model_name, model_version, request_id, server_s
    )


def answer_metadata(
    timings: Timings,
    lengths: tuple[int, ...] | None,
    model_name: str,
    model_version: str,
    request_id: str,
    server_s: float,
) -> bytes:
    """Every field of the ``EmbedResponse`` but the tensor, as wire bytes.

    Written by hand like the tensor: building the two messages and serialising them cost
    a tiny request more than the rest of its encode. Fields in number order, zeros and
    empty strings left out but ``timings`` always present, as protobuf itself writes a
    response whose timings were set (tests compare the bytes).
    """
    parts: list[bytes] = []
    if lengths:
        packed = b"".join([varint(length) for length in lengths])
        parts += [_LENGTHS_KEY, varint(len(packed)), packed]
    timing_fields = b"".join([
        _double_field(_QUEUE_SECONDS_KEY, timings.queue_s),
        _double_field(_COMPUTE_SECONDS_KEY, timings.compute_s),
        _double_field(_SERVER_SECONDS_KEY, server_s),
        _varint_field(_BATCH_REQUESTS_KEY, timings.batch_requests),
        _varint_field(_BATCH_TOKENS_KEY, timings.batch_tokens),
    ])  # fmt: skip
    parts += [
        _TIMINGS_KEY,
        varint(len(timing_fields)),
        timing_fields,  # always set, even if empty
        _model_fields(model_name, model_version),
        _string_field(_REQUEST_ID_KEY, request_id),
    ]
    return b"".join(parts)


@functools.lru_cache(maxsize=16)
def _model_fields(model_name: str, model_version: str) -> bytes:
    """The model's name and version fields: the same in every answer of a server."""
    return _string_field(_MODEL_NAME_KEY, model_name) + _string_field(
        _MODEL_VERSION_KEY, model_version
    )


def _double_field(key: bytes, value: float) -> bytes:
    return key + _pack_double(value) if value else b""


def _varint_field(key: bytes, value: int) -> bytes:
    return key + varint(value) if value else b""


def _string_field(key: bytes, value: str) -> bytes:
    if not value:
        return b""
    encoded = value.encode("utf-8")
    return key + varint(len(encoded)) + encoded


_pack_double = struct.Struct("<d").pack
# EmbedResponse fields 2..6 and Timings fields 1..5 (embedding.proto).
_LENGTHS_KEY = _key(2, _LEN)
_TIMINGS_KEY = _key(3, _LEN)
_MODEL_NAME_KEY = _key(4, _LEN)
_MODEL_VERSION_KEY = _key(5, _LEN)
_REQUEST_ID_KEY = _key(6, _LEN)
_QUEUE_SECONDS_KEY = _key(1, _I64)
_COMPUTE_SECONDS_KEY = _key(2, _I64)
_SERVER_SECONDS_KEY = _key(3, _I64)
_BATCH_REQUESTS_KEY = _key(4, _VARINT)
_BATCH_TOKENS_KEY = _key(5, _VARINT)


def encode_rows_response(
    shape: tuple[int, ...], pieces: Sequence[memoryview], metadata: bytes
) -> bytes:
    """What :func:`encode_response` writes for a float32 array of ``shape`` whose bytes
    are ``pieces`` joined in order (``EmbeddingService.embed_plain``'s rows): the array
    is never made, and its bytes are copied once, into the response."""
    prefix = _response_prefix(shape, _FLOAT32, math.prod(shape) * _FLOAT32.itemsize)
    return b"".join([prefix, *pieces, metadata])


_FLOAT32 = np.dtype("<f4")


def encode_response(array: np.ndarray, metadata: bytes) -> bytes:
    """``EmbedResponse`` wire bytes: the tensor field, then the other fields.

    Protobuf parsers merge fields in any order, so the tensor may come first.
    """
    if not array.flags.c_contiguous:
        raise ValueError("this is a bug: response arrays are made contiguous upstream")
    prefix = _response_prefix(array.shape, array.dtype, array.nbytes)
    return b"".join([prefix, array.data.cast("B"), metadata])


class InPlaceResponse:
    """``EmbedResponse`` bytes allocated before the answer exists, so that the look-up
    writes its rows straight into them (see ``inplace_bytes``): the same bytes
    ``encode_response`` would build, without the copy.

    The metadata goes last and must be exactly ``metadata_size`` bytes, told up front
    (it holds timings measured after the look-up: the caller sizes it with stand-in
    values of the same encoded width). ``finish`` returns None when the real metadata
    has another size, and the caller encodes by copying instead.
    """

    @staticmethod
    def available() -> bool:
        """False on an interpreter where bytes cannot be filled in place (see
        ``inplace_bytes``): encode by copying there."""
        return inplace_bytes.available()

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: np.dtype,
        metadata_size: int,
        allocate: Callable[[int], tuple[bytes, np.ndarray]] | None = None,
    ) -> None:
        """``allocate``: where the bytes come from (``SpareBytes.allocate`` reuses; by
        default ``inplace_bytes.allocate``, new bytes)."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        prefix = _response_prefix(shape, dtype, nbytes)
        size = len(prefix) + nbytes + metadata_size
        self._data, self._chars = (allocate or inplace_bytes.allocate)(size)
        self._chars[: len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
        self._metadata_at = len(prefix) + nbytes
        self.rows = self._chars[len(prefix) : self._metadata_at].view(dtype).reshape(shape)

    def finish(self, metadata: bytes) -> bytes | None:
        """The response bytes, or None if ``metadata`` is not of the size reserved."""
        if len(metadata) != len(self._data) - self._metadata_at:
            return None
        self._chars[self._metadata_at :] = np.frombuffer(metadata, dtype=np.uint8)
        # The bytes are about to be shared: nothing may write into them through this
        # response any more (a SpareBytes refills them only once nobody else holds them).
        self.rows.flags.writeable = False
        self._chars.flags.writeable = False
        return self._data


def encode_stream_answer(response_bytes: bytes) -> bytes:
    """Wrap encoded ``EmbedResponse`` bytes as ``EmbedStreamResponse.response``."""
    return b"".join([_key(1, _LEN), varint(len(response_bytes)), response_bytes])


def encode_stream_error(code: int, message: str, reason: str) -> bytes:
    error = pb.Error(code=code, message=message, reason=reason)
    return pb.EmbedStreamResponse(error=error).SerializeToString()


def encode_chunk_header(array: np.ndarray, metadata: bytes) -> bytes:
    """``EmbedChunk.header``: the response with the tensor's dtype and shape, no data."""
    tensor = _tensor_fields(array.shape, array.dtype)
    header = b"".join([_key(1, _LEN), varint(len(tensor)), tensor, metadata])
    return b"".join([_key(1, _LEN), varint(len(header)), header])


def encode_chunk_data(piece: memoryview) -> bytes:
    return b"".join([_key(2, _LEN), varint(piece.nbytes), piece])
