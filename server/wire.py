"""Protobuf <-> domain, and the response bytes, encoded by hand around the tensor.

Building an ``EmbedResponse`` message and serialising it copies the tensor twice (into
the message, then into the wire bytes). Writing the few header bytes ourselves and
joining them with the array's buffer copies it once. The bytes are standard protobuf
wire format: any protobuf client parses them (tests/server/test_wire.py proves it
against the generated classes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from tokembed.server.domain import FLAT, PADDED, EmbedInput, EmbedOutput
from tokembed.server.errors import InvalidInput
from tokembed.v1 import embedding_pb2 as pb

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

_LEN = 2  # protobuf wire type of length-delimited fields
_VARINT = 0


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


def _tensor_header(array: np.ndarray) -> bytes:
    """A Tensor message up to (and including) the length prefix of its data field."""
    packed_shape = b"".join(varint(int(dim)) for dim in array.shape)
    return b"".join([
        _key(1, _VARINT), varint(_WIRE_DTYPES[array.dtype]),
        _key(2, _LEN), varint(len(packed_shape)), packed_shape,
        _key(3, _LEN), varint(array.nbytes),
    ])  # fmt: skip


def response_metadata(
    output: EmbedOutput, model_name: str, model_version: str, request_id: str, server_s: float
) -> pb.EmbedResponse:
    """Every field of the response but the tensor's data (small; built as a message)."""
    timings = output.timings
    return pb.EmbedResponse(
        lengths=output.lengths or (),
        timings=pb.Timings(
            queue_seconds=timings.queue_s,
            compute_seconds=timings.compute_s,
            server_seconds=server_s,
            batch_requests=timings.batch_requests,
            batch_tokens=timings.batch_tokens,
        ),
        model_name=model_name,
        model_version=model_version,
        request_id=request_id,
    )


def encode_response(array: np.ndarray, metadata: pb.EmbedResponse) -> bytes:
    """``EmbedResponse`` wire bytes: the tensor field by hand, then the rest as a message.

    Protobuf parsers merge fields in any order, so appending the serialised metadata
    message is the same as one message holding everything.
    """
    if not array.flags.c_contiguous:
        raise ValueError("this is a bug: response arrays are made contiguous upstream")
    header = _tensor_header(array)
    tensor_length = len(header) + array.nbytes
    return b"".join([
        _key(1, _LEN), varint(tensor_length), header,
        array.data.cast("B"),
        metadata.SerializeToString(),
    ])  # fmt: skip


def encode_stream_answer(response_bytes: bytes) -> bytes:
    """Wrap encoded ``EmbedResponse`` bytes as ``EmbedStreamResponse.response``."""
    return b"".join([_key(1, _LEN), varint(len(response_bytes)), response_bytes])


def encode_stream_error(code: int, message: str, reason: str) -> bytes:
    error = pb.Error(code=code, message=message, reason=reason)
    return pb.EmbedStreamResponse(error=error).SerializeToString()


def encode_chunk_header(array: np.ndarray, metadata: pb.EmbedResponse) -> bytes:
    header = pb.EmbedResponse()
    header.CopyFrom(metadata)
    header.hidden_states.dtype = _WIRE_DTYPES[array.dtype]
    header.hidden_states.shape.extend(int(dim) for dim in array.shape)
    return pb.EmbedChunk(header=header).SerializeToString()


def encode_chunk_data(piece: memoryview) -> bytes:
    return b"".join([_key(2, _LEN), varint(piece.nbytes), piece])
