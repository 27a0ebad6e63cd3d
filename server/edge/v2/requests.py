"""Open Inference Protocol request bytes -> the data plane's requests: the deserializers
gRPC calls for the V2 methods.

A ``ModelInferRequest`` becomes an embed request: the input ``input_ids`` (INT64 or INT32,
``[B, S]``; or ``[N]`` flat with an input ``lengths`` of ``[B]``: ragged), any further
input of the model's kind by its name (``token_type_ids``), and the answer's datatype,
named by a ``datatype`` parameter on the requested output or on the request (FP32 unless
asked). The ids' bytes are ``raw_input_contents`` (what tritonclient sends) or the typed
``contents`` field, or a shared-memory region (``shm_service.SharedMemoryInputs``): where
they come from is one step (``InputSource``). Raw contents are the message's own bytes,
in hand as tokembed.v1's ids are (taking them costs at most what the message did); typed
contents (converted to bytes) and regions are read only once the request's declarations
fit the model (``Unread``): so a request whose inputs are all raw contents has nothing
left to read, and the data plane validates it at once. Which regions a request may read
depends on who sent it, which only the RPC's handler knows: such an input
(``CallersInput``) is told its caller there (``InferCall.sent_by``), before the data plane
reads it.

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
from tokembed.server.core.operations.embed import request_over_limit
from tokembed.server.core.operations.embed_request import (
    FLAT,
    LENGTHS,
    PADDED,
    EmbedInput,
    IdsInput,
    Unread,
)
from tokembed.server.edge.v2 import nearest
from tokembed.server.edge.v2.nearest import NearestCall
from tokembed.server.edge.v2.parameters import string_parameter
from tokembed.server.edge.v2.text import (
    DetokenizeCall,
    TextCall,
    asks_texts,
    detokenize_call,
    is_text,
    text_call,
)
from tokembed.v2 import grpc_service_pb2 as pb

# The V2 datatype names, by the rows of the server's dtype table (``core.dtypes``): a row
# added there (BF16) is a datatype here with no edit.
V2_ID_DTYPES = {dtype.v2: dtype.name for dtype in ID_DTYPES.values()}
V2_OUTPUT_DTYPES = {dtype.v2: dtype.name for dtype in OUTPUT_DTYPES.values()}
DEFAULT_OUTPUT_DTYPE = "float32"  # what the model computes; the answer unless asked

# Far above what any model kind takes (input_ids, lengths, and a kind's further ids:
# export.kinds): the model's own inputs are checked later, but a request naming tens of
# thousands of inputs would cost the loop a descriptor each before that.
MAX_INPUTS = 16
DATATYPE_PARAMETER = "datatype"  # the answer's datatype (on the requested output or request)
LAYOUT_PARAMETER = "ragged_layout"  # "padded" (the default) or "flat"
_LAYOUTS = {"padded": PADDED, "flat": FLAT}


@dataclass(slots=True)
class InferCall(Request[EmbedInput]):
    """A ModelInferRequest, translated: the embed request, and the outputs it asked for
    (their parameters say where and how the answer goes: the sink reads them)."""

    outputs: Sequence[pb.ModelInferRequest.InferRequestedOutputTensor] = ()
    callers_inputs: tuple[CallersInput, ...] = ()  # the inputs only its caller may read

    def sent_by(self, caller: str) -> None:
        """Tells the inputs only their caller may read who that is (an opaque key from the
        front end's authentication, ``auth.Identities``)."""
        for sent in self.callers_inputs:
            sent.caller = caller


class CallersInput(Unread):
    """An input that only the identity which sent the request may read (a shared-memory
    region: each identity's regions are its own). gRPC's deserializer, which makes it,
    does not know the caller: the RPC's handler names it (``InferCall.sent_by``) before
    the data plane reads it; ``caller`` is None until then."""

    __slots__ = ("caller",)

    def __init__(self) -> None:
        self.caller: str | None = None


# Where an input's bytes are: the request, its index among the inputs; returns them
# in hand (the message's raw contents) or unread (``Unread``). Raises ``EmbedError`` for
# what it can tell from the request alone.
InputSource = Callable[["pb.ModelInferRequest", int], bytes | Unread]
SHARED_MEMORY_REGION = "shared_memory_region"  # an input's parameter naming its region


class InferParser:
    """The deserializer of ModelInfer and ModelStreamInfer.

    gRPC receives messages up to its own limit, set above the largest valid request (the
    server's ``max_request_bytes``) so that a larger one reaches this point and is refused
    by its size alone, before it is decoded. No input's bytes are read here: each input
    becomes a descriptor (name, datatype, shape, where its bytes are), checked against
    the model it is routed to before anything is read (``operations.embed.read``).
    """

    def __init__(self, max_bytes: int, max_tokens: int, source: InputSource | None = None) -> None:
        """``source``: where an input's bytes come from (default: the request itself)."""
        self._max_bytes = max_bytes
        self._max_tokens = max_tokens
        self._source = source or in_request

    def __call__(
        self, data: bytes
    ) -> InferCall | NearestCall | TextCall | DetokenizeCall | Refused:
        if len(data) > self._max_bytes:
            return Refused(request_over_limit(len(data), self._max_bytes, self._max_tokens))
        try:
            request = pb.ModelInferRequest.FromString(data)
        except DecodeError as exc:
            return Refused(InvalidInput(f"the request is not a valid ModelInferRequest: {exc}"))
        base = nearest.base_name(request.model_name)
        if base is not None:  # NAME.nearest: the nearest operation of NAME
            try:
                return nearest.nearest_call(request, base, self._source)
            except EmbedError as error:
                return Refused(error, request.id)
        if is_text(request):  # texts, not ids (``edge.v2.text``)
            try:
                return text_call(request, V2_OUTPUT_DTYPES, self._source, self._max_bytes)
            except EmbedError as error:
                return Refused(error, request.id)
        if asks_texts(request):  # ids to texts (``edge.v2.text``)
            try:
                return detokenize_call(request)
            except EmbedError as error:
                return Refused(error, request.id)
        try:
            body = self.embed_input(request)
        except EmbedError as error:
            return Refused(error, request.id)
        outputs = request.outputs
        return InferCall(
            request.model_name, request.model_version, body, request.id,
            tuple(outputs) if outputs else (), _callers_inputs(body),
        )  # fmt: skip

    def embed_input(self, request: pb.ModelInferRequest) -> EmbedInput:
        """The embed request a ModelInferRequest asks for, its inputs in hand or unread
        (``InputSource``); raises ``EmbedError``."""
        if len(request.inputs) > MAX_INPUTS:
            raise InvalidInput(
                f"the request has {len(request.inputs)} inputs; an embed request takes at "
                f"most {MAX_INPUTS} (input_ids, {LENGTHS} and the model kind's further ids)"
            )
        raw = len(request.raw_input_contents)
        if raw and raw != len(request.inputs):
            raise InvalidInput(
                f"the request has {len(request.inputs)} inputs but {raw} "
                "raw_input_contents; send one raw content per input, in the inputs' order"
            )
        ids: IdsInput | None = None
        lengths: IdsInput | None = None
        more: dict[str, IdsInput] = {}
        for index, tensor in enumerate(request.inputs):
            name = tensor.name
            if (
                name in more
                or (name == INPUT_NAME and ids is not None)
                or (name == LENGTHS and lengths is not None)
            ):
                raise InvalidInput(f"input {name!r} is given twice")
            dtype = V2_ID_DTYPES.get(tensor.datatype)
            if dtype is None:
                raise InvalidInput(
                    f"input {name!r} datatype {tensor.datatype or '(none)'} is not "
                    f"supported; send {' or '.join(V2_ID_DTYPES)}"
                )
            sent = IdsInput(dtype, tuple(tensor.shape), self._source(request, index))
            if name == INPUT_NAME:
                ids = sent
            elif name == LENGTHS:
                lengths = sent
            else:  # the model's kind says whether it takes it (checked before any read)
                more[name] = sent
        return EmbedInput(
            ids_dtype=ids.dtype if ids is not None else "",
            shape=ids.shape if ids is not None else (),
            data=ids.data if ids is not None else None,
            output_dtype=_output_dtype(request),
            layout=_layout(request.parameters),
            more_ids=more or None,
            lengths_input=lengths,
        )


class InContents(Unread):
    """An input's typed ``contents`` in the request's message (int64_contents for INT64,
    int_contents for INT32): made bytes (little-endian) only when the data plane reads it,
    once the request's declarations fit the model."""

    __slots__ = ("_dtype", "_values")

    def __init__(self, tensor: pb.ModelInferRequest.InferInputTensor) -> None:
        self._dtype = ID_DTYPES[V2_ID_DTYPES[tensor.datatype]]  # the parser took only these
        contents = tensor.contents
        self._values = (
            contents.int64_contents if self._dtype.itemsize == 8 else contents.int_contents
        )

    declared = False  # their size is that of the values the message carries

    @property
    def nbytes(self) -> int:
        return self._dtype.itemsize * len(self._values)

    async def read(self) -> bytes:
        return np.asarray(self._values, dtype=self._dtype.numpy).tobytes()


def in_request(request: pb.ModelInferRequest, index: int) -> bytes | InContents:
    """The default ``InputSource``: inputs in the request only. Raw contents are taken as
    they are (the message's bytes); typed contents stay in the message until read."""
    tensor = request.inputs[index]
    if SHARED_MEMORY_REGION in tensor.parameters:
        raise InvalidInput(
            f"input {tensor.name!r} names a shared-memory region, and this server reads "
            "inputs from the request only"
        )
    raw = request.raw_input_contents
    if raw:
        if tensor.HasField("contents"):
            raise InvalidInput(
                f"input {tensor.name!r} has both contents and raw_input_contents; send one"
            )
        return raw[index]
    return InContents(tensor)


def _callers_inputs(body: EmbedInput) -> tuple[CallersInput, ...]:
    if body.more_ids is None and body.lengths_input is None:  # the ids alone: most requests
        return (body.data,) if isinstance(body.data, CallersInput) else ()
    sent = [body.data, *(more.data for more in (body.more_ids or {}).values())]
    if body.lengths_input is not None:
        sent.append(body.lengths_input.data)
    return tuple(data for data in sent if isinstance(data, CallersInput))


def _output_dtype(request: pb.ModelInferRequest) -> str:
    """The answer's dtype (a ``core.dtypes`` name): the requested output's ``datatype``
    parameter, else the request's, else float32."""
    asked = ""
    for output in request.outputs or ():
        if output.name != OUTPUT_NAME:
            raise InvalidInput(
                f"unexpected inference output {output.name!r}; the model's output is {OUTPUT_NAME}"
            )
        asked = string_parameter(output.parameters, DATATYPE_PARAMETER) or asked
    asked = asked or string_parameter(request.parameters, DATATYPE_PARAMETER)
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
    asked = string_parameter(parameters, LAYOUT_PARAMETER)
    if not asked:
        return PADDED
    layout = _LAYOUTS.get(asked.lower())
    if layout is None:
        raise InvalidInput(
            f"parameter {LAYOUT_PARAMETER} = {asked!r} is not supported; use padded or flat"
        )
    return layout


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
