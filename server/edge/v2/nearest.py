"""``nearest`` on the Open Inference Protocol: a second model name per model.

A model ``NAME`` with a head (``manifest.Head``) is also served as ``NAME.nearest``: its
ModelMetadata and ModelConfig describe the operation (inputs ``vectors`` FP32, FP16 or
BF16 ``[N, D]`` or ``[B, S, D]``, and ``k`` INT64 ``[1]``; outputs ``ids`` INT64,
``scores`` FP32 and, when requested, ``logits`` FP32), ModelReady answers for it, and a
ModelInferRequest naming it is a nearest request. tritonclient needs nothing new: it
sends a model name, inputs and requested outputs. The ``metric`` (``dot`` or ``cosine``)
and ``apply_norm`` are request parameters; the ``logits`` are answered when requested as
an output. A separate name, not a per-model input, because a Triton model has one set of
inputs and outputs, which ModelMetadata and ModelConfig describe.

Names ending in ``.nearest`` are therefore this protocol's: a served model's own name
never does (``core.repository`` would serve it, but V2 reads it as this). Nearest
requests are served in ModelStreamInfer too, beside look-ups, answered in order (one
whose output names a shared-memory region is refused there, as a look-up's is).

System shared memory (``shm``) as for the look-up: ``vectors`` may name a region of the
caller's (described here, read by ``Nearest.read`` only once everything the request
declares, the window's size included, fits the model), and each requested output may
name a region of its own, into which its tensor is written (``shm_service.
TensorsSharedMemorySink``). ``k`` is 8 bytes and says what the request costs, so it comes
in the request itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tokembed.server.core.dataplane import Request
from tokembed.server.core.errors import InvalidInput
from tokembed.server.core.operations.embed_request import Unread
from tokembed.server.core.operations.nearest import (
    IDS,
    LOGITS,
    SCORES,
    VECTOR_DTYPES,
    NearestInput,
    head_of,
)
from tokembed.server.core.served import ServedModel
from tokembed.server.core.types import Answer
from tokembed.server.edge.v2.parameters import bool_parameter, string_parameter
from tokembed.v2 import grpc_service_pb2 as pb
from tokembed.v2 import model_config_pb2 as config_pb

SUFFIX = ".nearest"
VECTORS, K = "vectors", "k"
METRIC_PARAMETER, NORM_PARAMETER = "metric", "apply_norm"
OUTPUTS = (IDS, SCORES, LOGITS)
SHARED_MEMORY_REGION = "shared_memory_region"
# The V2 datatype names of the vectors' dtypes (the server's table, ``core.dtypes``).
_V2_VECTOR_DTYPES = {dtype.v2: dtype.name for dtype in VECTOR_DTYPES.values()}


def base_name(model_name: str) -> str | None:
    """The model a ``NAME.nearest`` name is the nearest operation of; None for others."""
    return model_name[: -len(SUFFIX)] if model_name.endswith(SUFFIX) else None


@dataclass(slots=True)
class NearestCall(Request[NearestInput]):
    """A nearest request, with its requested outputs (those naming a shared-memory region
    are written there: the servicer takes their windows)."""

    outputs: tuple[pb.ModelInferRequest.InferRequestedOutputTensor, ...] = ()


def nearest_call(
    request: pb.ModelInferRequest,
    model_name: str,
    source: Callable[[pb.ModelInferRequest, int], bytes | Unread],
) -> NearestCall:
    """A ModelInferRequest for ``NAME.nearest`` (``model_name``: ``NAME``) as a nearest
    request; raises ``InvalidInput`` naming what this protocol cannot express.
    ``source``: where an input naming a shared-memory region is (``requests.InputSource``:
    unread; refused when the server has no shared memory)."""
    raw = request.raw_input_contents
    # The raw contents are those of the inputs not in a region, in their order (Triton's
    # rule: tritonclient sends none for an input in shared memory).
    in_message = [t for t in request.inputs if SHARED_MEMORY_REGION not in t.parameters]
    if raw and len(raw) != len(in_message):
        raise InvalidInput(
            f"the request has {len(in_message)} inputs outside shared memory but {len(raw)} "
            "raw_input_contents"
        )
    found: dict[str, tuple[pb.ModelInferRequest.InferInputTensor, bytes | Unread]] = {}
    raw_index = 0
    for tensor in request.inputs:
        if tensor.name not in (VECTORS, K):
            raise InvalidInput(f"unexpected input {tensor.name!r}; {model_name}{SUFFIX} takes "
                               f"{VECTORS} and {K}")  # fmt: skip
        if tensor.name in found:
            raise InvalidInput(f"input {tensor.name!r} is given twice")
        if SHARED_MEMORY_REGION in tensor.parameters:
            if tensor.name == K:
                raise InvalidInput(f"input {K!r} names a shared-memory region; send k (one "
                                   "INT64) in the request itself")  # fmt: skip
            # The source sees this input alone: its bytes are the region's, not a raw
            # content's.
            found[tensor.name] = (tensor, source(pb.ModelInferRequest(inputs=[tensor]), 0))
            continue
        found[tensor.name] = (tensor, raw[raw_index] if raw else _typed(tensor))
        raw_index += 1
    if VECTORS not in found:
        raise InvalidInput(f"input {VECTORS!r} is missing")
    vectors, data = found[VECTORS]
    dtype = _V2_VECTOR_DTYPES.get(vectors.datatype)
    if dtype is None:
        raise InvalidInput(f"input {VECTORS!r} datatype {vectors.datatype or '(none)'} is not "
                           f"supported; send {' or '.join(_V2_VECTOR_DTYPES)}")  # fmt: skip
    logits = False
    for output in request.outputs:
        if output.name not in OUTPUTS:
            raise InvalidInput(f"unexpected output {output.name!r}; {model_name}{SUFFIX} "
                               f"answers {', '.join(OUTPUTS)}")  # fmt: skip
        if any(other.name == output.name for other in request.outputs if other is not output):
            raise InvalidInput(f"output {output.name!r} is requested twice")
        logits = logits or output.name == LOGITS
    return NearestCall(
        model_name,
        request.model_version,
        NearestInput(
            data=data, dtype=dtype, shape=tuple(vectors.shape), k=_k(found.get(K)),
            metric=string_parameter(request.parameters, METRIC_PARAMETER) or "dot", logits=logits,
            norm=bool_parameter(request.parameters, NORM_PARAMETER),
        ),
        request.id,
        tuple(request.outputs),
    )  # fmt: skip


def _typed(tensor: pb.ModelInferRequest.InferInputTensor) -> bytes:
    contents = tensor.contents
    if tensor.name == K:
        values = contents.int64_contents or contents.int_contents
        return np.asarray(values, dtype="<i8").tobytes()
    if tensor.datatype != "FP32":
        raise InvalidInput(
            f"input {tensor.name!r} of {tensor.datatype} must be sent as raw_input_contents "
            "(the typed contents have no such field)"
        )
    return np.asarray(contents.fp32_contents, dtype="<f4").tobytes()


def _k(sent: tuple[pb.ModelInferRequest.InferInputTensor, bytes | Unread] | None) -> int:
    if sent is None:
        return 1
    tensor, data = sent
    assert isinstance(data, bytes), "This is a bug: k in a region is refused above."
    if tensor.datatype not in ("INT64", "INT32") or list(tensor.shape) != [1]:
        raise InvalidInput(f"input {K!r} must be INT64 (or INT32) of shape [1], got "
                           f"{tensor.datatype} {list(tensor.shape)}")  # fmt: skip
    width = 8 if tensor.datatype == "INT64" and len(data) != 4 else 4
    if len(data) != width:
        raise InvalidInput(f"input {K!r} holds {len(data)} bytes, one {tensor.datatype} is {width}")
    value = int(np.frombuffer(data, dtype="<i8" if width == 8 else "<i4")[0])
    if value < 0:
        raise InvalidInput(f"k = {value} is negative")
    return value


# --- the answer: several named outputs


def infer_response(answer: Answer, request_id: str) -> bytes:
    """A ModelInferResponse of every named tensor of ``answer`` (``Answer.tensors``), in
    order, one ``raw_output_contents`` each: what any answer of several tensors is."""
    tensor = pb.ModelInferResponse.InferOutputTensor
    return pb.ModelInferResponse(
        model_name=answer.model_name,
        model_version=answer.model_version,
        id=request_id,
        outputs=[tensor(name=t.name, datatype=t.dtype.v2, shape=t.shape) for t in answer.tensors],
        raw_output_contents=[b"".join(t.pieces) for t in answer.tensors],
    ).SerializeToString()


# --- the model, described


def model_metadata(served: ServedModel, versions: list[str]) -> pb.ModelMetadataResponse:
    head_of(served)  # a model without a head has no nearest name
    tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=served.name + SUFFIX,
        versions=versions,
        platform="tokembed_nearest",
        inputs=[
            tensor(name=VECTORS, datatype="FP32", shape=[-1, served.d_model]),
            tensor(name=K, datatype="INT64", shape=[1]),
        ],
        outputs=[
            tensor(name=IDS, datatype="INT64", shape=[-1, -1]),
            tensor(name=SCORES, datatype="FP32", shape=[-1, -1]),
            tensor(name=LOGITS, datatype="FP32", shape=[-1, served.vocab_size]),
        ],
    )


def model_config(served: ServedModel, max_message_bytes: int) -> pb.ModelConfigResponse:
    head = head_of(served)

    def type_of(name: str) -> config_pb.DataType.ValueType:
        return config_pb.DataType.Value(f"TYPE_{name}")

    config = config_pb.ModelConfig(
        name=served.name + SUFFIX,
        platform="tokembed_nearest",
        backend="numpy",
        max_batch_size=0,
        input=[
            config_pb.ModelInput(name=VECTORS, data_type=type_of("FP32"),
                                 dims=[-1, served.d_model]),
            config_pb.ModelInput(name=K, data_type=type_of("INT64"), dims=[1], optional=True),
        ],
        output=[
            config_pb.ModelOutput(name=IDS, data_type=type_of("INT64"), dims=[-1, -1]),
            config_pb.ModelOutput(name=SCORES, data_type=type_of("FP32"), dims=[-1, -1]),
            config_pb.ModelOutput(name=LOGITS, data_type=type_of("FP32"),
                                  dims=[-1, served.vocab_size]),
        ],
    )  # fmt: skip
    config.dynamic_batching.max_queue_delay_microseconds = int(served.batch.max_delay_s * 1e6)
    facts: dict[str, object] = {
        "operation": "nearest",
        "model": served.name,
        "version": served.version,
        "table": head.table_role,
        "final_norm": head.norm.kind if head.norm is not None else "",
        "vectors_datatypes": ",".join(_V2_VECTOR_DTYPES),
        "metrics": "dot,cosine",
        "max_k": min(served.limits.max_nearest_k, served.vocab_size),
        "runs_on": head.runs_on,
        "max_batch_rows": served.batch.nearest_max_batch_rows,
        "max_message_bytes": max_message_bytes,
    }
    for key, value in facts.items():
        config.parameters[key].string_value = str(value)
    return pb.ModelConfigResponse(config=config)
