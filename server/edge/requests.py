"""tokembed.v1 request bytes -> the core's types: the deserializers gRPC calls.

A deserializer that raises makes gRPC answer UNKNOWN on its own, past our status table
and metrics; these never raise. Bytes that do not parse become ``Malformed``, which the
servicer refuses as INVALID_ARGUMENT like any other bad input (inside a stream: one
error answer).
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from tokembed.server.core.types import FLAT, PADDED, EmbedInput
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


@dataclass(slots=True)
class Malformed:
    """Request bytes that are not the message the method takes."""

    message: str  # what to tell the caller
    request_id: str = ""


@dataclass(slots=True)
class EmbedCall:
    """One Embed request: which model, the input, and the id to echo."""

    model_name: str
    input: EmbedInput
    request_id: str


@dataclass(slots=True)
class ModelQuery:
    """GetModelInfo's request: which model ("" for the default one)."""

    model_name: str


def parse_embed(data: bytes) -> EmbedCall | Malformed:
    """The deserializer of Embed, EmbedStream and EmbedChunked."""
    try:
        request = pb.EmbedRequest.FromString(data)
    except DecodeError as exc:
        return Malformed(f"the request is not a valid tokembed.v1.EmbedRequest: {exc}")
    tensor = request.input_ids
    return EmbedCall(
        request.model_name,
        EmbedInput(
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
        ),
        request.request_id,
    )


def parse_model_query(data: bytes) -> ModelQuery | Malformed:
    """The deserializer of GetModelInfo."""
    try:
        return ModelQuery(pb.GetModelInfoRequest.FromString(data).model_name)
    except DecodeError:
        return Malformed("the request is not a valid tokembed.v1.GetModelInfoRequest")


def parse_list_models(data: bytes) -> Malformed | None:
    """The deserializer of ListModels (its request has no fields)."""
    try:
        pb.ListModelsRequest.FromString(data)
    except DecodeError:
        return Malformed("the request is not a valid tokembed.v1.ListModelsRequest")
    return None


def _enum_name(enum: object, value: int) -> str:
    try:
        return str(enum.Name(value))  # type: ignore[attr-defined]
    except ValueError:
        return f"{value} (unknown {enum.DESCRIPTOR.name} value)"  # type: ignore[attr-defined]
