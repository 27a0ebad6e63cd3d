"""The core's answers -> Open Inference Protocol response bytes, and the descriptions of
the models (ModelMetadata, ModelConfig, RepositoryIndex).

A ``ModelInferResponse`` is written by hand around the tensor, as tokembed.v1's answers
are, with the wire format's pieces both front ends share (``edge.wire``): the few header
bytes, then the answer's pieces (views of the looked-up rows) as ``raw_output_contents``,
joined once, so each byte of the tensor is copied once. A stream's answer
(``ModelStreamInferResponse.infer_response``) wraps the same parts in the same single join.
The bytes are those protobuf writes for the same message (fields in number order, empty
ones left out): tests/server/test_v2_responses.py compares them with the generated classes'
serialisation and parses them back.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

from tokembed.server.core.dtypes import ID_DTYPES, OUTPUT_DTYPES, DType
from tokembed.server.core.operations.text_request import (
    INPUT_IDS,
    LENGTHS,
    OFFSETS,
    SPECIAL_TOKENS_MASK,
    TEXT,
    TEXTS,
)
from tokembed.server.core.served import ServedModel
from tokembed.server.core.types import Answer, Buffer
from tokembed.server.edge.wire import LEN, field_key, string_field, varint
from tokembed.v2 import grpc_service_pb2 as pb
from tokembed.v2 import model_config_pb2 as config_pb

# ModelInferResponse fields 1, 2, 3, 5, 6; InferOutputTensor fields 1, 2, 3;
# ModelStreamInferResponse field 2 (grpc_service.proto).
_MODEL_NAME_KEY = field_key(1, LEN)
_MODEL_VERSION_KEY = field_key(2, LEN)
_ID_KEY = field_key(3, LEN)
_OUTPUTS_KEY = field_key(5, LEN)
_RAW_OUTPUT_KEY = field_key(6, LEN)
_TENSOR_NAME_KEY = field_key(1, LEN)
_TENSOR_DATATYPE_KEY = field_key(2, LEN)
_TENSOR_SHAPE_KEY = field_key(3, LEN)
_STREAM_RESPONSE_KEY = field_key(2, LEN)


# --- ModelInfer and ModelStreamInfer


def infer_response_parts(answer: Answer, output_name: str, request_id: str) -> list[Buffer]:
    """A ``ModelInferResponse``'s wire bytes, as parts to join: the model's name and
    version, the request's id, the output's description, then ``raw_output_contents``
    (its key and length, and the answer's pieces)."""
    return [
        model_fields(answer.model_name, answer.model_version),
        string_field(_ID_KEY, request_id),
        _output_prefix(output_name, answer.shape, answer.dtype, answer.nbytes),
        *answer.pieces,
    ]


def infer_response(answer: Answer, output_name: str, request_id: str) -> bytes:
    return b"".join(infer_response_parts(answer, output_name, request_id))


def stream_response(answer: Answer, output_name: str, request_id: str) -> bytes:
    """``ModelStreamInferResponse`` bytes whose ``infer_response`` is the answer (no error)."""
    parts = infer_response_parts(answer, output_name, request_id)
    size = sum(memoryview(part).nbytes for part in parts)
    return b"".join([_STREAM_RESPONSE_KEY, varint(size), *parts])


def stream_error(message: str) -> bytes:
    """A ``ModelStreamInferResponse`` for a request that failed: its ``error_message``
    (tritonclient's stream callback gets it as the error)."""
    return pb.ModelStreamInferResponse(error_message=message).SerializeToString()


@functools.lru_cache(maxsize=64)
def model_fields(model_name: str, model_version: str) -> bytes:
    return string_field(_MODEL_NAME_KEY, model_name) + string_field(
        _MODEL_VERSION_KEY, model_version
    )


def tensors_infer_response(answer: Answer, request_id: str) -> bytes:
    """A ``ModelInferResponse`` of any answer of several named tensors (``Answer.tensors``:
    NAME.nearest's, a tokenizer's): each described in ``outputs``, their bytes in
    ``raw_output_contents`` in the same order, each piece copied once."""
    return b"".join(_tensors_infer_response_parts(answer, request_id))


def tensors_stream_response(answer: Answer, request_id: str) -> bytes:
    """``ModelStreamInferResponse`` bytes whose ``infer_response`` is an answer of several
    named tensors, framed as :func:`tensors_infer_response` frames it, in the same join."""
    parts = _tensors_infer_response_parts(answer, request_id)
    size = sum(memoryview(part).nbytes for part in parts)
    return b"".join([_STREAM_RESPONSE_KEY, varint(size), *parts])


def _tensors_infer_response_parts(answer: Answer, request_id: str) -> list[Buffer]:
    parts: list[Buffer] = [
        model_fields(answer.model_name, answer.model_version),
        string_field(_ID_KEY, request_id),
    ]
    for tensor in answer.tensors:
        packed = b"".join([varint(int(dim)) for dim in tensor.shape])
        described = b"".join([
            string_field(_TENSOR_NAME_KEY, tensor.name),
            string_field(_TENSOR_DATATYPE_KEY, tensor.dtype.v2),
            _TENSOR_SHAPE_KEY + varint(len(packed)) + packed if packed else b"",
        ])  # fmt: skip
        parts += [_OUTPUTS_KEY, varint(len(described)), described]
    for tensor in answer.tensors:
        parts += [_RAW_OUTPUT_KEY, varint(tensor.nbytes), *tensor.pieces]
    return parts


def _output_prefix(name: str, shape: tuple[int, ...], dtype: DType, nbytes: int) -> bytes:
    """The ``outputs`` entry (name, datatype, shape) and ``raw_output_contents``' key and
    length: the same for every answer of one shape and dtype, so kept (as tokembed.v1
    keeps its prefixes; a caller of endless shapes gets no more than ``_PREFIXES_CACHED``)."""
    key = (name, shape, dtype.name)
    prefix = _prefixes.get(key)
    if prefix is None:
        packed_shape = b"".join([varint(int(dim)) for dim in shape])
        tensor = b"".join([
            string_field(_TENSOR_NAME_KEY, name),
            string_field(_TENSOR_DATATYPE_KEY, dtype.v2),
            _TENSOR_SHAPE_KEY, varint(len(packed_shape)), packed_shape,
        ])  # fmt: skip
        prefix = b"".join([_OUTPUTS_KEY, varint(len(tensor)), tensor, _RAW_OUTPUT_KEY,
                           varint(nbytes)])  # fmt: skip
        if len(_prefixes) < _PREFIXES_CACHED:
            _prefixes[key] = prefix
    return prefix


_PREFIXES_CACHED = 4096
_prefixes: dict[tuple[str, tuple[int, ...], str], bytes] = {}


# --- the models, described

# What ModelMetadata and ModelConfig declare: ids as int64 (int32 is taken too), the answer
# in float32 (a request may ask for another of OUTPUT_DTYPES).
_IDS = ID_DTYPES["int64"]
_ANSWER = OUTPUT_DTYPES["float32"]

# Triton's platform names: what computes a request's rows. The table backend's rows were
# computed by the model's ONNX graph once, at load; requests are slices of them.
PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "table": "tokembed_table"}


def platform(served: ServedModel) -> str:
    return PLATFORMS.get(served.backend.kind, served.backend.kind)


def model_metadata(served: ServedModel, versions: Sequence[str]) -> pb.ModelMetadataResponse:
    """What a model takes and answers: its kind's id inputs (``[B, S]``, -1 for either)
    and ``hidden_states`` ``[B, S, D]`` in float32, the answer a request asking for no
    other datatype gets."""
    manifest = served.model.manifest
    tensor = pb.ModelMetadataResponse.TensorMetadata
    inputs = [tensor(name=spec.name, datatype=_IDS.v2, shape=[-1, -1]) for spec in served.inputs]
    outputs = [
        tensor(name=manifest.output.name, datatype=_ANSWER.v2, shape=[-1, -1, served.d_model])
    ]
    if served.tokenizer is not None:  # texts in (edge.v2.text): the tokenizer's outputs
        inputs.append(tensor(name=TEXT, datatype="BYTES", shape=[-1]))
        outputs += [
            tensor(name=name, datatype=dtype.v2, shape=shape)
            for name, dtype, shape in _TOKENIZER_OUTPUTS
        ]
        outputs.append(tensor(name=TEXTS, datatype="BYTES", shape=[-1]))
    return pb.ModelMetadataResponse(
        name=served.name,
        versions=list(versions),
        platform=platform(served),
        inputs=inputs,
        outputs=outputs,
    )


# A model with a tokenizer answers texts with these too (``edge.v2.text``): [N] and [B]
# (every text's tokens one after another, and each text's count), [N, 2]; and ids with
# ``texts`` (BYTES [B], detokenizing).
_TOKENIZER_OUTPUTS = (
    (INPUT_IDS, ID_DTYPES["int64"], [-1]),
    (LENGTHS, ID_DTYPES["int64"], [-1]),
    (OFFSETS, ID_DTYPES["int64"], [-1, 2]),
    (SPECIAL_TOKENS_MASK, ID_DTYPES["int32"], [-1]),
)


def model_config(served: ServedModel, max_message_bytes: int) -> pb.ModelConfigResponse:
    """Triton's model configuration of a served model, as far as it applies: no batch
    dimension of Triton's own (``max_batch_size`` 0; B is the first of ``dims``), dynamic
    batching where the backend batches, and tokembed's own facts as parameters."""
    manifest = served.model.manifest
    backend = served.backend
    config = config_pb.ModelConfig(
        name=served.name,
        platform=platform(served),
        backend=backend.kind,
        max_batch_size=0,
        input=[
            config_pb.ModelInput(
                name=spec.name,
                data_type=_config_type(_IDS),
                dims=[-1, -1],
                optional=spec.optional,
            )
            for spec in served.inputs
        ],
        output=[
            config_pb.ModelOutput(
                name=manifest.output.name,
                data_type=_config_type(_ANSWER),
                dims=[-1, -1, served.d_model],
            )
        ],
    )
    if served.tokenizer is not None:
        config.input.append(
            config_pb.ModelInput(
                name=TEXT,
                data_type=config_pb.DataType.Value("TYPE_STRING"),
                dims=[-1],
                optional=True,
            )
        )
        config.output.extend(
            config_pb.ModelOutput(name=name, data_type=_config_type(dtype), dims=shape)
            for name, dtype, shape in _TOKENIZER_OUTPUTS
        )
        config.output.append(
            config_pb.ModelOutput(
                name=TEXTS, data_type=config_pb.DataType.Value("TYPE_STRING"), dims=[-1]
            )
        )
    if backend.batches:
        config.dynamic_batching.max_queue_delay_microseconds = int(served.batch.max_delay_s * 1e6)
    facts: dict[str, object] = {
        "kind": served.kind.name,
        "version": served.version,
        "vocab_size": served.vocab_size,
        "d_model": served.d_model,
        "scale": manifest.scale,
        "weight_dtype": manifest.weight_dtype,
        "execution_provider": backend.execution_provider,
        "model_sha256": served.model.model_sha256,
        "output_datatypes": ",".join(dtype.v2 for dtype in OUTPUT_DTYPES.values()),
        "max_tokens_per_request": served.limits.max_tokens_per_request,
        "max_output_bytes_per_request": served.limits.max_output_bytes_per_request,
        "max_message_bytes": max_message_bytes,
    }
    if manifest.padding_idx is not None:
        facts["padding_id"] = manifest.padding_idx
    if served.tokenizer is not None and manifest.tokenizer is not None:
        facts["tokenizer"] = manifest.tokenizer.model
        facts["tokenizer_max_length"] = served.tokenizer.max_length
        facts["tokenizer_sha256"] = manifest.files[manifest.tokenizer.file].sha256
    if manifest.pretrained is not None:
        # As tokembed.v1's GetModelInfo reports them (architecture, convention,
        # engine_scales), one parameter each: "engine_scale_vllm", ...
        facts["architecture"] = manifest.pretrained.architecture
        facts["convention"] = manifest.pretrained.convention
        for engine, scale in sorted(manifest.pretrained.engine_scales.items()):
            facts[f"engine_scale_{engine}"] = repr(scale)
    for key, value in facts.items():
        config.parameters[key].string_value = str(value)
    return pb.ModelConfigResponse(config=config)


def _config_type(dtype: DType) -> config_pb.DataType.ValueType:
    """model_config.proto's ``TYPE_<V2 name>``."""
    return config_pb.DataType.Value(f"TYPE_{dtype.v2}")


# Triton's model states (RepositoryIndex), by the repository's.
STATES = {"loading": "LOADING", "ready": "READY", "draining": "UNLOADING",
          "unloaded": "UNAVAILABLE"}  # fmt: skip


def repository_index(
    models: Iterable[tuple[str, str, str]], ready_only: bool
) -> pb.RepositoryIndexResponse:
    """``models``: (name, version, repository state) of every version held."""
    index = pb.RepositoryIndexResponse.ModelIndex
    return pb.RepositoryIndexResponse(
        models=[
            index(name=name, version=version, state=STATES.get(state, state.upper()))
            for name, version, state in models
            if not ready_only or state == "ready"
        ]
    )
