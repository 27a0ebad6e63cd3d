"""tokembed.v1's text RPCs (Tokenize, Detokenize, EmbedText): their requests parsed into
the data plane's, their answers framed.

A ``TensorsResponse`` is written by hand, as Embed's answer is (``responses``): each named
tensor's few header bytes, then its pieces (an EmbedText answer's rows are views of the
looked-up rows), joined once. The bytes are those protobuf writes for the same message
(fields in number order, empty ones left out): tests/server/test_text_frames.py compares
them with the generated classes' serialisation.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError

from tokembed.server.core.dataplane import Refused, Request
from tokembed.server.core.dtypes import ID_DTYPES, OUTPUT_DTYPES, DType
from tokembed.server.core.errors import InvalidInput
from tokembed.server.core.named_tensors import TensorsAnswer, TextsAnswer
from tokembed.server.core.operations.embed import request_over_limit
from tokembed.server.core.operations.text_request import DetokenizeInput, TextInput
from tokembed.server.core.types import Buffer, Timings
from tokembed.server.edge.v1.requests import WIRE_ID_DTYPES, WIRE_OUTPUT_DTYPES
from tokembed.server.edge.wire import I64, LEN, VARINT, field_key, string_field, varint
from tokembed.v1 import embedding_pb2 as pb

# --- requests


class TextParser:
    """The deserializer of one text RPC: bytes over the largest valid request refused by
    their size alone (as Embed's are), bytes that do not parse refused; never raises."""

    def __init__(
        self, parse: Callable[[bytes], Request[Any] | Refused], max_bytes: int, max_tokens: int
    ) -> None:
        self._parse = parse
        self._max_bytes = max_bytes
        self._max_tokens = max_tokens

    def __call__(self, data: bytes) -> Request[Any] | Refused:
        if len(data) > self._max_bytes:
            return Refused(request_over_limit(len(data), self._max_bytes, self._max_tokens))
        return self._parse(data)


def _parsed(message: Any, data: bytes) -> Any:
    try:
        return message.FromString(data)
    except DecodeError as exc:
        return Refused(
            InvalidInput(f"the request is not a valid tokembed.v1.{message.__name__}: {exc}")
        )


def _truncate(value: int) -> bool:
    if value in (pb.TRUNCATION_UNSPECIFIED, pb.TRUNCATION_REFUSE):
        return False
    if value == pb.TRUNCATION_TRUNCATE:
        return True
    raise InvalidInput(f"truncation {value} is not a Truncation; use REFUSE or TRUNCATE")


def _add_special(request: Any) -> bool:
    return bool(request.add_special_tokens) if request.HasField("add_special_tokens") else True


def parse_tokenize(data: bytes) -> Request[TextInput] | Refused:
    request = _parsed(pb.TokenizeRequest, data)
    if isinstance(request, Refused):
        return request
    try:
        body = TextInput(list(request.texts), _add_special(request), _truncate(request.truncation))
    except InvalidInput as error:
        return Refused(error, request.request_id)
    return Request(request.model_name, request.model_version, body, request.request_id)


def parse_embed_text(data: bytes) -> Request[TextInput] | Refused:
    request = _parsed(pb.EmbedTextRequest, data)
    if isinstance(request, Refused):
        return request
    dtype = request.output_dtype
    named = WIRE_OUTPUT_DTYPES.get(dtype, str(dtype))
    try:
        body = TextInput(
            list(request.texts), _add_special(request), _truncate(request.truncation),
            "float32" if dtype == pb.DTYPE_UNSPECIFIED else named,
        )  # fmt: skip
    except InvalidInput as error:
        return Refused(error, request.request_id)
    return Request(request.model_name, request.model_version, body, request.request_id)


def parse_detokenize(data: bytes) -> Request[DetokenizeInput] | Refused:
    request = _parsed(pb.DetokenizeRequest, data)
    if isinstance(request, Refused):
        return request
    ids = request.input_ids
    body = DetokenizeInput(
        WIRE_ID_DTYPES.get(ids.dtype, str(ids.dtype)), tuple(ids.shape), ids.data,
        tuple(request.lengths), request.skip_special_tokens,
    )  # fmt: skip
    return Request(request.model_name, request.model_version, body, request.request_id)


# --- answers

_CODES: dict[DType, int] = {
    **{ID_DTYPES[name]: code for code, name in WIRE_ID_DTYPES.items()},
    **{OUTPUT_DTYPES[name]: code for code, name in WIRE_OUTPUT_DTYPES.items()},
}
_TENSORS_KEY = field_key(1, LEN)  # TensorsResponse.tensors
_TIMINGS_KEY = field_key(2, LEN)
_MODEL_NAME_KEY = field_key(3, LEN)
_MODEL_VERSION_KEY = field_key(4, LEN)
_REQUEST_ID_KEY = field_key(5, LEN)
_NAME_KEY = field_key(1, LEN)  # NamedTensor.name
_TENSOR_KEY = field_key(2, LEN)  # NamedTensor.tensor
_DTYPE_KEY = field_key(1, VARINT)  # Tensor.dtype, .shape, .data
_SHAPE_KEY = field_key(2, LEN)
_DATA_KEY = field_key(3, LEN)
_PACK_DOUBLE = struct.Struct("<d").pack


def tensors_response(answer: TensorsAnswer, request_id: str, server_s: float) -> bytes:
    """``TensorsResponse`` wire bytes: each named tensor, then the timings and names."""
    parts: list[Buffer] = []
    for tensor in answer.tensors:
        packed = b"".join([varint(int(dim)) for dim in tensor.shape])
        head = b"".join([_DTYPE_KEY, varint(_CODES[tensor.dtype])])
        if packed:
            head += _SHAPE_KEY + varint(len(packed)) + packed
        data_head = _DATA_KEY + varint(tensor.nbytes) if tensor.nbytes else b""
        tensor_size = len(head) + len(data_head) + tensor.nbytes
        name = string_field(_NAME_KEY, tensor.name)
        named_size = len(name) + len(_TENSOR_KEY) + len(varint(tensor_size)) + tensor_size
        parts += [_TENSORS_KEY, varint(named_size), name, _TENSOR_KEY, varint(tensor_size), head]
        if tensor.nbytes:
            parts += [data_head, *tensor.pieces]
    parts += [
        _timings(answer.timings, server_s),
        string_field(_MODEL_NAME_KEY, answer.model_name),
        string_field(_MODEL_VERSION_KEY, answer.model_version),
        string_field(_REQUEST_ID_KEY, request_id),
    ]
    return b"".join(parts)


def _timings(timings: Timings, server_s: float) -> bytes:
    """The ``timings`` field (always present, as protobuf writes a set message)."""
    fields = b"".join([
        _double(1, timings.queue_s), _double(2, timings.compute_s), _double(3, server_s),
        _varint(4, timings.batch_requests), _varint(5, timings.batch_tokens),
    ])  # fmt: skip
    return _TIMINGS_KEY + varint(len(fields)) + fields


def _double(number: int, value: float) -> bytes:
    return field_key(number, I64) + _PACK_DOUBLE(value) if value else b""


def _varint(number: int, value: int) -> bytes:
    return field_key(number, VARINT) + varint(value) if value else b""


def detokenize_response(answer: TextsAnswer, request_id: str) -> bytes:
    return pb.DetokenizeResponse(
        texts=answer.texts, model_name=answer.model_name, model_version=answer.model_version,
        request_id=request_id,
    ).SerializeToString()  # fmt: skip
