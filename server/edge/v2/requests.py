"""Open Inference Protocol request bytes -> the data plane's requests: the deserializers
gRPC calls for the V2 methods.

A ``ModelInferRequest`` becomes an embed request: the input ``input_ids`` (INT64 or INT32,
``[B, S]``; or ``[N]`` flat with an input ``lengths`` of ``[B]``: ragged), any further
input of the model's kind by its name (``token_type_ids``), and the answer's datatype,
named by a ``datatype`` parameter on the requested output or on the request (FP32 unless
asked). The ids' bytes are ``raw_input_contents`` (what tritonclient sends) or the typed
``contents`` field; where they come from is one step (``InputSource``), so that another
source (a shared-memory region) is one more case there. Which regions a request may read
depends on who sent it, which only the RPC's handler knows: a request with an input in a
region is decoded here and translated there (``Unread``, ``InferParser.read``).

As for tokembed.v1, a deserializer that raises makes gRPC answer UNKNOWN past our status
table and metrics, so these never raise: bytes that do not parse, a request this protocol
cannot express as an embed request, or one over the size of the largest valid request
become ``Refused``, which the data plane refuses as any other bad input.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from tokembed.export.manifest import INPUT_NAME, OUTPUT_NAME
from tokembed.server.core.dataplane import ModelQuery, Refused, Request
from tokembed.server.core.dtypes import ID_DTYPES, OUTPUT_DTYPES
from tokembed.server.core.errors import EmbedError, InvalidInput
from tokembed.server.core.operations.embed import (
    FLAT,
    PADDED,
    EmbedInput,
    IdsInput,
    request_over_limit,
)
from tokembed.v2 import grpc_service_pb2 as pb

# The V2 datatype names, by the rows of the server's dtype table (``core.dtypes``): a row
# added there (BF16) is a datatype here with no edit.
V2_ID_DTYPES = {dtype.v2: dtype.name for dtype in ID_DTYPES.values()}
V2_OUTPUT_DTYPES = {dtype.v2: dtype.name for dtype in OUTPUT_DTYPES.values()}
DEFAULT_OUTPUT_DTYPE = "float32"  # what the model computes; the answer unless asked

LENGTHS_NAME = "lengths"  # the ragged input's sequence lengths
DATATYPE_PARAMETER = "datatype"  # the answer's datatype (on the requested output or request)
LAYOUT_PARAMETER = "ragged_layout"  # "padded" (the default) or "flat"
_LAYOUTS = {"padded": PADDED, "flat": FLAT}


@dataclass(slots=True)
class InferCall(Request[EmbedInput]):
    """A ModelInferRequest, translated: the embed request, and the outputs it asked for
    (their parameters say where and how the answer goes: the sink reads them)."""

    outputs: Sequence[pb.ModelInferRequest.InferRequestedOutputTensor] = ()


# An input's bytes, from the request: the input's message, and its entry of
# raw_input_contents (None: the request has none). Raises ``EmbedError``.
InputSource = Callable[["pb.ModelInferRequest.InferInputTensor", "bytes | None"], bytes]
# The source of a request's inputs for the caller who sent it (an opaque key from the
# front end's authentication: the regions it may read are its own).
CallersSource = Callable[[str], InputSource]
SHARED_MEMORY_REGION = "shared_memory_region"  # an input's parameter naming its region


@dataclass(slots=True)
class Unread:
    """A ModelInferRequest with an input in a shared-memory region, decoded, its inputs
    not read: the RPC's handler reads them for its caller (``InferParser.read``)."""

    request: pb.ModelInferRequest

    @property
    def request_id(self) -> str:
        return str(self.request.id)

    @property
    def outputs(self) -> Sequence[pb.ModelInferRequest.InferRequestedOutputTensor]:
        return self.request.outputs


class InferParser:
    """The deserializer of ModelInfer and ModelStreamInfer.

    gRPC receives messages up to its own limit, set above the largest valid request (the
    server's ``max_request_bytes``) so that a larger one reaches this point and is refused
    by its size alone, before it is decoded.
    """

    def __init__(
        self, max_bytes: int, max_tokens: int, source_for: CallersSource | None = None
    ) -> None:
        """``source_for``: where a caller's inputs that name a shared-memory region are read
        from (None: such an input is refused)."""
        self._max_bytes = max_bytes
        self._max_tokens = max_tokens
        self._source_for = source_for

    def __call__(self, data: bytes) -> InferCall | Unread | Refused:
        if len(data) > self._max_bytes:
            return Refused(request_over_limit(len(data), self._max_bytes, self._max_tokens))
        try:
            request = pb.ModelInferRequest.FromString(data)
        except DecodeError as exc:
            return Refused(InvalidInput(f"the request is not a valid ModelInferRequest: {exc}"))
        if self._source_for is not None and any(
            SHARED_MEMORY_REGION in tensor.parameters for tensor in request.inputs
        ):
            return Unread(request)
        return self._translate(request, contents_of)

    def read(self, unread: Unread, caller: str) -> InferCall | Refused:
        """``unread``'s inputs read for ``caller``, and the request translated."""
        if self._source_for is None:
            raise AssertionError("this is a bug: a request left unread with no source to read")
        return self._translate(unread.request, self._source_for(caller))

    def _translate(self, request: pb.ModelInferRequest, source: InputSource) -> InferCall | Refused:
        try:
            return InferCall(
                request.model_name, request.model_version, self.embed_input(request, source),
                request.id, tuple(request.outputs) if request.outputs else (),
            )  # fmt: skip
        except EmbedError as error:
            return Refused(error, request.id)

    def embed_input(self, request: pb.ModelInferRequest, source: InputSource) -> EmbedInput:
        """The embed request a ModelInferRequest asks for, its inputs' bytes from
        ``source``; raises ``EmbedError``."""
        raw = request.raw_input_contents
        if raw and len(raw) != len(request.inputs):
            raise InvalidInput(
                f"the request has {len(request.inputs)} inputs but {len(raw)} "
                "raw_input_contents; send one raw content per input, in the inputs' order"
            )
        ids: IdsInput | None = None
        lengths: tuple[int, ...] = ()
        more: dict[str, IdsInput] = {}
        for index, tensor in enumerate(request.inputs):
            if tensor.name in more or (tensor.name == INPUT_NAME and ids is not None):
                raise InvalidInput(f"input {tensor.name} is given twice")
            dtype = V2_ID_DTYPES.get(tensor.datatype)
            if dtype is None:
                raise InvalidInput(
                    f"input {tensor.name} datatype {tensor.datatype or '(none)'} is not "
                    f"supported; send {' or '.join(V2_ID_DTYPES)}"
                )
            sent = IdsInput(dtype, tuple(tensor.shape), source(tensor, raw[index] if raw else None))
            if tensor.name == INPUT_NAME:
                ids = sent
            elif tensor.name == LENGTHS_NAME:
                lengths = _lengths(sent)
            else:  # the model's kind says whether it takes it (validation)
                more[tensor.name] = sent
        if ids is None:
            raise InvalidInput(f"input {INPUT_NAME} is missing")
        return EmbedInput(
            ids_dtype=ids.dtype,
            shape=ids.shape,
            data=ids.data,
            lengths=lengths,
            output_dtype=_output_dtype(request),
            layout=_layout(request.parameters),
            more_ids=more or None,
        )


def contents_of(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None) -> bytes:
    """An input's bytes as the request carries them: its raw content, or its typed
    ``contents`` (int64_contents for INT64, int_contents for INT32), little-endian."""
    if SHARED_MEMORY_REGION in tensor.parameters:
        raise InvalidInput(
            f"input {tensor.name} names a shared-memory region, and this server reads inputs "
            "from the request only"
        )
    if raw is not None:
        if tensor.HasField("contents"):
            raise InvalidInput(
                f"input {tensor.name} has both contents and raw_input_contents; send one"
            )
        return raw
    dtype = ID_DTYPES[V2_ID_DTYPES[tensor.datatype]]  # the parser took only these
    values = tensor.contents.int64_contents if dtype.itemsize == 8 else tensor.contents.int_contents
    return np.asarray(values, dtype=dtype.numpy).tobytes()


def _lengths(sent: IdsInput) -> tuple[int, ...]:
    """The ragged input's lengths as ints (validation checks them against the ids)."""
    dtype = ID_DTYPES[sent.dtype]
    if len(sent.shape) != 1:
        raise InvalidInput(f"input {LENGTHS_NAME} shape {list(sent.shape)} must be [B]")
    if len(sent.data) != sent.shape[0] * dtype.itemsize:
        raise InvalidInput(
            f"input {LENGTHS_NAME} data is {len(sent.data)} bytes, but shape "
            f"{list(sent.shape)} of {dtype.v2} needs {sent.shape[0] * dtype.itemsize}"
        )
    if not sent.shape[0]:
        raise InvalidInput(f"input {LENGTHS_NAME} is empty; send one length per sequence")
    return tuple(np.frombuffer(sent.data, dtype=dtype.numpy).tolist())


def _output_dtype(request: pb.ModelInferRequest) -> str:
    """The answer's dtype (a ``core.dtypes`` name): the requested output's ``datatype``
    parameter, else the request's, else float32."""
    asked = ""
    for output in request.outputs or ():
        if output.name != OUTPUT_NAME:
            raise InvalidInput(
                f"unexpected inference output {output.name!r}; the model's output is {OUTPUT_NAME}"
            )
        asked = _string_parameter(output.parameters, DATATYPE_PARAMETER) or asked
    asked = asked or _string_parameter(request.parameters, DATATYPE_PARAMETER)
    if not asked:
        return DEFAULT_OUTPUT_DTYPE
    dtype = V2_OUTPUT_DTYPES.get(asked)
    if dtype is None:
        raise InvalidInput(
            f"datatype {asked} is not supported for {OUTPUT_NAME}; ask for "
            f"{' or '.join(V2_OUTPUT_DTYPES)}"
        )
    return dtype


def _layout(parameters: Mapping[str, pb.InferParameter]) -> str:
    asked = _string_parameter(parameters, LAYOUT_PARAMETER)
    if not asked:
        return PADDED
    layout = _LAYOUTS.get(asked.lower())
    if layout is None:
        raise InvalidInput(
            f"parameter {LAYOUT_PARAMETER} = {asked!r} is not supported; use padded or flat"
        )
    return layout


def _string_parameter(parameters: Mapping[str, pb.InferParameter], name: str) -> str:
    if name not in parameters:
        return ""
    parameter = parameters[name]
    if parameter.WhichOneof("parameter_choice") != "string_param":
        raise InvalidInput(f"parameter {name} must be a string")
    return str(parameter.string_param)


def parse_message(message: Any) -> Callable[[bytes], Any]:
    """The deserializer of a message class: the message, or ``Refused``."""

    def parse(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except DecodeError:
            return Refused(InvalidInput(f"the request is not a valid {message.__name__}"))

    return parse


def parse_model_query(message: Any) -> Callable[[bytes], ModelQuery | Refused]:
    """The deserializer of a request naming a model and a version (``name``, ``version``:
    ModelReady, ModelMetadata, ModelConfig, ModelStatistics)."""
    parse = parse_message(message)

    def query(data: bytes) -> ModelQuery | Refused:
        parsed = parse(data)
        return parsed if isinstance(parsed, Refused) else ModelQuery(parsed.name, parsed.version)

    return query
