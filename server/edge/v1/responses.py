"""The core's answers -> tokembed.v1 response bytes, encoded by hand around the tensor.

Building an ``EmbedResponse`` message and serialising it copies the tensor twice (into
the message, then into the wire bytes). Writing the few header bytes ourselves and
joining them with the answer's pieces (views of the looked-up rows) copies each byte
once, straight into the response. The bytes are standard protobuf wire format, and for
the answers a server makes (a tensor never empty; timings, which are durations, never
negative) the very bytes protobuf itself writes: tests/server/test_responses.py compares
``EmbedResponse`` (unary), ``EmbedStreamResponse`` (a stream's answer) and each
``EmbedChunk`` (the header, the data slices) with the generated classes' serialisation,
byte for byte, at every varint width, and parses them back field by field. Stream errors
and the model descriptions are built with the generated classes.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterator, Sequence

from tokembed.server.core.dtypes import ID_DTYPES, OUTPUT_DTYPES, DType
from tokembed.server.core.served import ServedModel
from tokembed.server.core.types import Answer, Buffer, Timings
from tokembed.server.edge.v1.requests import WIRE_ID_DTYPES, WIRE_OUTPUT_DTYPES
from tokembed.server.edge.wire import I64, LEN, VARINT, field_key, string_field, varint
from tokembed.v1 import embedding_pb2 as pb

_WIRE_DTYPES = {OUTPUT_DTYPES[name]: code for code, name in WIRE_OUTPUT_DTYPES.items()}

# --- EmbedResponse


def embed_response(answer: Answer, request_id: str, server_s: float) -> bytes:
    """``EmbedResponse`` wire bytes: the tensor field, then the other fields (protobuf
    parsers merge fields in any order, so the tensor may come first)."""
    metadata = answer_metadata(
        answer.timings, answer.lengths, answer.model_name, answer.model_version, request_id,
        server_s,
    )  # fmt: skip
    prefix = _response_prefix(answer.shape, answer.dtype, answer.nbytes)
    return b"".join([prefix, *answer.pieces, metadata])


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
    parts += [
        _timings_field(_TIMINGS_KEY, timings, server_s),
        _model_fields(model_name, model_version),
        string_field(_REQUEST_ID_KEY, request_id),
    ]
    return b"".join(parts)


def _timings_field(key: bytes, timings: Timings, server_s: float) -> bytes:
    """A ``timings`` field: always present (even empty), as protobuf writes a set message."""
    fields = b"".join([
        _double_field(_QUEUE_SECONDS_KEY, timings.queue_s),
        _double_field(_COMPUTE_SECONDS_KEY, timings.compute_s),
        _double_field(_SERVER_SECONDS_KEY, server_s),
        _varint_field(_BATCH_REQUESTS_KEY, timings.batch_requests),
        _varint_field(_BATCH_TOKENS_KEY, timings.batch_tokens),
    ])  # fmt: skip
    return key + varint(len(fields)) + fields


# --- EmbedStream, EmbedChunked and NearestChunked


def stream_answer(response_bytes: bytes) -> bytes:
    """Wrap encoded ``EmbedResponse`` bytes as ``EmbedStreamResponse.response``."""
    return b"".join([field_key(1, LEN), varint(len(response_bytes)), response_bytes])


def stream_error(code: int, message: str, reason: str) -> bytes:
    error = pb.Error(code=code, message=message, reason=reason)
    return pb.EmbedStreamResponse(error=error).SerializeToString()


def chunk_header(answer: Answer, request_id: str, server_s: float) -> bytes:
    """The first ``EmbedChunk``'s wire bytes: the response without the tensor's data."""
    metadata = answer_metadata(
        answer.timings, answer.lengths, answer.model_name, answer.model_version, request_id,
        server_s,
    )  # fmt: skip
    tensor = _tensor_fields(answer.shape, answer.dtype)
    header = b"".join([field_key(1, LEN), varint(len(tensor)), tensor, metadata])
    return b"".join([field_key(1, LEN), varint(len(header)), header])


def chunk_slices(pieces: Sequence[Buffer], chunk_bytes: int) -> Iterator[bytes]:
    """The ``EmbedChunk`` (or ``TensorsChunk``: the same field) messages after the
    header: the answer's bytes in slices of at most ``chunk_bytes``, each made when it is
    asked for (so an answer is never whole in memory twice)."""
    for size, group in _groups(pieces, chunk_bytes):
        yield b"".join([_CHUNK_DATA_KEY, varint(size), *group])


def _groups(pieces: Sequence[Buffer], limit: int) -> Iterator[tuple[int, list[Buffer]]]:
    """``pieces`` regrouped into runs of at most ``limit`` bytes (a piece larger than
    what a run has room for is cut), with each run's size; only the last may be short."""
    group: list[Buffer] = []
    size = 0
    for piece in pieces:
        length = len(piece)  # bytes (``types.Buffer``)
        if length <= limit - size:  # it fits whole: an answer of row views is mostly these
            if length:
                group.append(piece)
                size += length
                if size == limit:
                    yield size, group
                    group, size = [], 0
            continue
        view = memoryview(piece)
        while view.nbytes:
            room = limit - size
            if view.nbytes <= room:
                group.append(view)
                size += view.nbytes
                break
            group.append(view[:room])
            view = view[room:]
            yield limit, group
            group, size = [], 0
        if size == limit:
            yield size, group
            group, size = [], 0
    if group:
        yield size, group


# --- GetModelInfo and ListModels


def model_info(served: ServedModel, max_message_bytes: int) -> pb.ModelInfo:
    """The served model and the limits a caller must respect."""
    manifest = served.model.manifest
    backend = served.backend
    answer = pb.ModelInfo(
        name=manifest.name,
        version=manifest.version,
        vocab_size=manifest.vocab_size,
        d_model=manifest.d_model,
        scale=manifest.scale,
        weight_dtype=manifest.weight_dtype,
        input_dtypes=list(WIRE_ID_DTYPES),
        output_dtypes=list(WIRE_OUTPUT_DTYPES),
        execution_provider=backend.execution_provider,
        limits=pb.Limits(
            max_tokens_per_request=served.limits.max_tokens_per_request,
            max_output_bytes_per_request=served.limits.max_output_bytes_per_request,
            max_batch_tokens=served.batch.max_batch_tokens,
            max_message_bytes=max_message_bytes,
            max_delay_seconds=served.batch.max_delay_s,
        ),
        model_sha256=served.model.model_sha256,
        backend=backend.kind,
    )
    if manifest.padding_idx is not None:
        answer.padding_id = manifest.padding_idx
    answer.kind = served.kind.name
    for spec, bound in zip(served.inputs, served.bounds, strict=True):
        answer.inputs.add(
            name=spec.name, bound=bound, bound_field=spec.bound_field, optional=spec.optional
        )
    for table in served.kind.tables(manifest):
        answer.tables.add(role=table.role, shape=table.shape, dtype=manifest.weight_dtype)
    head = backend.head
    if head is not None:
        norm = head.norm.kind if head.norm is not None else ""
        max_k = min(served.limits.max_nearest_k, head.vocab_size)
        answer.head.CopyFrom(
            pb.HeadInfo(table=head.table_role, norm=norm, max_k=max_k, runs_on=head.runs_on)
        )
    answer.memory_bytes.update(backend.memory_bytes)
    if head is not None and head.memory_bytes:
        # A head that cannot read the look-up's table maps its own, in its stored dtype.
        answer.memory_bytes[f"{head.stored_dtype} head table (mapped)"] = head.memory_bytes
    if head is not None and head.int8_bytes:
        answer.memory_bytes["int8 head table (first pass)"] = head.int8_bytes
    answer.serving_memory_bytes.update(backend.serving_memory)
    tokenizer = manifest.tokenizer
    if tokenizer is not None and served.tokenizer is not None:
        answer.tokenizer.model = tokenizer.model
        answer.tokenizer.vocab_size = served.tokenizer.vocab_size
        answer.tokenizer.max_length = served.tokenizer.max_length
        answer.tokenizer.sha256 = manifest.files[tokenizer.file].sha256
    if manifest.pretrained is not None:
        answer.architecture = manifest.pretrained.architecture
        answer.convention = manifest.pretrained.convention
        answer.engine_scales.update(manifest.pretrained.engine_scales)
    return answer


def tensors_response(answer: Answer, request_id: str, server_s: float) -> bytes:
    """``TensorsResponse`` wire bytes for any answer of several named tensors
    (``Answer.tensors``: nearest's, a tokenizer's), written by hand as Embed's answer is:
    each tensor's pieces copied once, into the response; then the timings and the names."""
    return b"".join(_tensors_response_parts(answer, request_id, server_s, with_data=True))


def tensors_chunk_header(answer: Answer, request_id: str, server_s: float) -> bytes:
    """The first ``TensorsChunk``'s wire bytes: the ``TensorsResponse`` with every
    tensor's name, dtype and shape but none of its data (which ``chunk_slices`` sends
    after it, the tensors' pieces one after another: ``TensorsChunk.data`` is field 2,
    as ``EmbedChunk.data`` is)."""
    header = b"".join(_tensors_response_parts(answer, request_id, server_s, with_data=False))
    return b"".join([field_key(1, LEN), varint(len(header)), header])


def _tensors_response_parts(
    answer: Answer, request_id: str, server_s: float, *, with_data: bool
) -> list[Buffer]:
    parts: list[Buffer] = []
    for tensor in answer.tensors:
        packed = b"".join([varint(int(dim)) for dim in tensor.shape])
        head = field_key(1, VARINT) + varint(_TENSOR_DTYPES[tensor.dtype])
        if packed:
            head += field_key(2, LEN) + varint(len(packed)) + packed
        nbytes = tensor.nbytes if with_data else 0
        data_head = field_key(3, LEN) + varint(nbytes) if nbytes else b""
        tensor_size = len(head) + len(data_head) + nbytes
        name = string_field(_NAME_KEY, tensor.name)
        named_size = len(name) + len(_TENSOR_KEY) + len(varint(tensor_size)) + tensor_size
        parts += [_TENSORS_KEY, varint(named_size), name, _TENSOR_KEY, varint(tensor_size), head]
        if nbytes:
            parts += [data_head, *tensor.pieces]
    parts += [
        _timings_field(_TENSORS_TIMINGS_KEY, answer.timings, server_s),
        string_field(_TENSORS_MODEL_NAME_KEY, answer.model_name),
        string_field(_TENSORS_MODEL_VERSION_KEY, answer.model_version),
        string_field(_TENSORS_REQUEST_ID_KEY, request_id),
    ]
    return parts


# Every dtype a named tensor may be in (ids and answers), to its wire enum value.
_TENSOR_DTYPES = {
    **{ID_DTYPES[name]: code for code, name in WIRE_ID_DTYPES.items()},
    **_WIRE_DTYPES,
}
# TensorsResponse fields 1..5, NamedTensor fields 1..2 (embedding.proto).
_TENSORS_KEY = field_key(1, LEN)
_TENSORS_TIMINGS_KEY = field_key(2, LEN)
_TENSORS_MODEL_NAME_KEY = field_key(3, LEN)
_TENSORS_MODEL_VERSION_KEY = field_key(4, LEN)
_TENSORS_REQUEST_ID_KEY = field_key(5, LEN)
_NAME_KEY = field_key(1, LEN)
_TENSOR_KEY = field_key(2, LEN)


def list_models(
    served: Sequence[ServedModel], default_model: str, max_message_bytes: int
) -> pb.ListModelsResponse:
    return pb.ListModelsResponse(
        models=[model_info(model, max_message_bytes) for model in served],
        default_model=default_model,
    )


# --- tokembed.v1's messages, in the wire format's pieces (edge.wire)


def _tensor_fields(shape: tuple[int, ...], dtype: DType) -> bytes:
    """A Tensor message's dtype and shape fields."""
    packed_shape = b"".join([varint(int(dim)) for dim in shape])
    return b"".join([
        field_key(1, VARINT), varint(_WIRE_DTYPES[dtype]),
        field_key(2, LEN), varint(len(packed_shape)), packed_shape,
    ])  # fmt: skip


def _response_prefix(shape: tuple[int, ...], dtype: DType, nbytes: int) -> bytes:
    """An EmbedResponse up to its tensor's data: the tensor field's key and length, the
    Tensor's dtype and shape, and its data field's key and length.

    Cached by shape and dtype (which fix ``nbytes``): building one is a dozen small
    steps, a measurable part of a tiny request's handler; callers send few distinct
    shapes.
    """
    key = (shape, dtype.name)
    prefix = _prefixes.get(key)
    if prefix is None:
        tensor_header = b"".join([_tensor_fields(shape, dtype), field_key(3, LEN), varint(nbytes)])
        prefix = b"".join([field_key(1, LEN), varint(len(tensor_header) + nbytes), tensor_header])
        if len(_prefixes) < _PREFIXES_CACHED:  # a caller of endless shapes gets no more
            _prefixes[key] = prefix
    return prefix


_PREFIXES_CACHED = 4096
_prefixes: dict[tuple[tuple[int, ...], str], bytes] = {}


@functools.lru_cache(maxsize=64)
def _model_fields(model_name: str, model_version: str) -> bytes:
    """The model's name and version fields: the same in every answer of a model."""
    return string_field(_MODEL_NAME_KEY, model_name) + string_field(
        _MODEL_VERSION_KEY, model_version
    )


def _double_field(key: bytes, value: float) -> bytes:
    return key + _pack_double(value) if value else b""


def _varint_field(key: bytes, value: int) -> bytes:
    return key + varint(value) if value else b""


_pack_double = struct.Struct("<d").pack
# EmbedResponse fields 2..6, Timings fields 1..5 (embedding.proto), EmbedChunk.data.
_LENGTHS_KEY = field_key(2, LEN)
_TIMINGS_KEY = field_key(3, LEN)
_MODEL_NAME_KEY = field_key(4, LEN)
_MODEL_VERSION_KEY = field_key(5, LEN)
_REQUEST_ID_KEY = field_key(6, LEN)
_QUEUE_SECONDS_KEY = field_key(1, I64)
_COMPUTE_SECONDS_KEY = field_key(2, I64)
_SERVER_SECONDS_KEY = field_key(3, I64)
_BATCH_REQUESTS_KEY = field_key(4, VARINT)
_BATCH_TOKENS_KEY = field_key(5, VARINT)
_CHUNK_DATA_KEY = field_key(2, LEN)
