"""tokembed.v1 request bytes -> the data plane's requests: the deserializers gRPC calls.

A deserializer that raises makes gRPC answer UNKNOWN on its own, past our status table
and metrics; these never raise. Bytes that do not parse, or that are more than the
largest valid request, become ``Refused``, which the data plane refuses like any other
bad input (INVALID_ARGUMENT, or RESOURCE_EXHAUSTED for too large; inside a stream: one
error answer).
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from tokembed.export.kinds import TOKEN_TYPE_IDS
from tokembed.server.core.dataplane import ModelQuery, Refused, Request
from tokembed.server.core.dtypes import ID_DTYPES, OUTPUT_DTYPES
from tokembed.server.core.errors import InvalidInput, TooLarge
from tokembed.server.core.operations.embed import (
    BATCH_FIRST,
    FLAT,
    PADDED,
    SEQUENCE_FIRST,
    EmbedInput,
    IdsInput,
    request_over_limit,
)
from tokembed.server.core.operations.nearest import NearestInput
from tokembed.v1 import embedding_pb2 as pb


def _wire_names(names: list[str]) -> dict[pb.DType.ValueType, str]:
    """The proto's ``DTYPE_<NAME>`` enum value of each dtype named in the server's table
    (``core.dtypes``): the table is the one place a dtype is defined."""
    return {pb.DType.Value(f"DTYPE_{name.upper()}"): name for name in names}


# The wire's dtypes, by the names of core.dtypes (responses.py writes them back).
WIRE_ID_DTYPES = _wire_names(list(ID_DTYPES))
WIRE_OUTPUT_DTYPES = _wire_names(list(OUTPUT_DTYPES))
_OUTPUT_DTYPE_NAMES = {pb.DTYPE_UNSPECIFIED: "float32", **WIRE_OUTPUT_DTYPES}
_LAYOUT_NAMES = {
    pb.RAGGED_LAYOUT_UNSPECIFIED: PADDED,
    pb.RAGGED_LAYOUT_PADDED: PADDED,
    pb.RAGGED_LAYOUT_FLAT: FLAT,
}
_ORDER_NAMES = {
    pb.LAYOUT_UNSPECIFIED: BATCH_FIRST,
    pb.LAYOUT_BATCH_FIRST: BATCH_FIRST,
    pb.LAYOUT_SEQUENCE_FIRST: SEQUENCE_FIRST,
}

EmbedCall = Request[EmbedInput]


class EmbedParser:
    """The deserializer of Embed, EmbedStream and EmbedChunked.

    gRPC receives messages up to its own limit, which is set well above the largest
    valid request so that a larger one reaches this point and gets our answer (naming
    the limit and the setting that raises it); it is refused by its size alone, before
    it is decoded (one-byte lengths decode into 8-byte integers, twice over).
    """

    def __init__(self, max_bytes: int, max_tokens: int) -> None:
        self._max_bytes = max_bytes
        self._max_tokens = max_tokens

    @property
    def max_bytes(self) -> int:
        """The largest valid request (the text RPCs' parsers share it)."""
        return self._max_bytes

    @property
    def max_tokens(self) -> int:
        return self._max_tokens

    def __call__(self, data: bytes) -> EmbedCall | Refused:
        if len(data) > self._max_bytes:
            return Refused(request_over_limit(len(data), self._max_bytes, self._max_tokens))
        return parse_embed(data)


def parse_embed(data: bytes) -> EmbedCall | Refused:
    """An EmbedRequest's bytes as a data plane ``Request`` (whatever their size)."""
    try:
        request = pb.EmbedRequest.FromString(data)
    except DecodeError as exc:
        return Refused(InvalidInput(f"the request is not a valid tokembed.v1.EmbedRequest: {exc}"))
    tensor = request.input_ids
    more_ids = None
    if request.HasField("token_type_ids"):
        types = request.token_type_ids
        more_ids = {
            TOKEN_TYPE_IDS: IdsInput(_id_dtype_name(types.dtype), tuple(types.shape), types.data)
        }
    return Request(
        request.model_name,
        request.model_version,
        EmbedInput(
            ids_dtype=_id_dtype_name(tensor.dtype),
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
            order=_ORDER_NAMES.get(request.layout) or _enum_name(pb.Layout, request.layout),
            more_ids=more_ids,
        ),
        request.request_id,
    )


NearestCall = Request[NearestInput]
_METRIC_NAMES = {pb.METRIC_UNSPECIFIED: "dot", pb.METRIC_DOT: "dot", pb.METRIC_COSINE: "cosine"}


class NearestParser:
    """The deserializer of Nearest: refused by its size alone past ``max_bytes`` (what
    ``max_vectors`` float32 vectors of the widest served model take), else decoded."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes

    def __call__(self, data: bytes) -> NearestCall | Refused:
        if len(data) > self._max_bytes:
            return Refused(TooLarge(f"the request is {len(data)} bytes, over the limit of "
                                    f"{self._max_bytes} bytes"))  # fmt: skip
        try:
            request = pb.NearestRequest.FromString(data)
        except DecodeError as exc:
            return Refused(
                InvalidInput(f"the request is not a valid tokembed.v1.NearestRequest: {exc}")
            )
        vectors = request.vectors
        return Request(
            request.model_name,
            request.model_version,
            NearestInput(
                data=vectors.data,
                dtype=(
                    WIRE_OUTPUT_DTYPES.get(vectors.dtype)
                    or ("" if vectors.dtype == pb.DTYPE_UNSPECIFIED
                        else _enum_name(pb.DType, vectors.dtype))
                ),
                shape=tuple(vectors.shape),
                k=request.k,
                metric=_METRIC_NAMES.get(request.metric) or _enum_name(pb.Metric, request.metric),
                logits=request.logits,
                norm=request.apply_norm,
            ),
            request.request_id,
        )  # fmt: skip


def _id_dtype_name(dtype: pb.DType.ValueType) -> str:
    return WIRE_ID_DTYPES.get(dtype) or _enum_name(pb.DType, dtype)


def parse_model_query(data: bytes) -> ModelQuery | Refused:
    """The deserializer of GetModelInfo."""
    try:
        query = pb.GetModelInfoRequest.FromString(data)
    except DecodeError:
        return Refused(InvalidInput("the request is not a valid tokembed.v1.GetModelInfoRequest"))
    return ModelQuery(query.model_name, query.model_version)


def parse_list_models(data: bytes) -> Refused | None:
    """The deserializer of ListModels (its request has no fields)."""
    try:
        pb.ListModelsRequest.FromString(data)
    except DecodeError:
        return Refused(InvalidInput("the request is not a valid tokembed.v1.ListModelsRequest"))
    return None


def _enum_name(enum: object, value: int) -> str:
    try:
        return str(enum.Name(value))  # type: ignore[attr-defined]
    except ValueError:
        return f"{value} (unknown {enum.DESCRIPTOR.name} value)"  # type: ignore[attr-defined]
