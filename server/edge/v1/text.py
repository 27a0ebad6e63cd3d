"""tokembed.v1's text RPCs (Tokenize, Detokenize, EmbedText): their requests parsed into
the data plane's, and Detokenize's answer framed (Tokenize's and EmbedText's are answers of
several named tensors, framed as every such answer is: ``responses.tensors_response``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError

from tokembed.server.core.dataplane import Refused, Request
from tokembed.server.core.errors import InvalidInput
from tokembed.server.core.operations.embed import request_over_limit
from tokembed.server.core.operations.text_request import DetokenizeInput, TextInput
from tokembed.server.core.texts_answer import TextsAnswer
from tokembed.server.edge.v1.requests import WIRE_ID_DTYPES, WIRE_OUTPUT_DTYPES
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


def detokenize_response(answer: TextsAnswer, request_id: str) -> bytes:
    return pb.DetokenizeResponse(
        texts=answer.texts, model_name=answer.model_name, model_version=answer.model_version,
        request_id=request_id,
    ).SerializeToString()  # fmt: skip
