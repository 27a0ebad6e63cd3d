"""Text through the Open Inference Protocol: a ``ModelInferRequest`` whose input is
``text`` (BYTES, shape ``[B]``: one UTF-8 text per element), answered by the model's own
tokenizer, then, unless only the tokenizer's outputs are asked for, by its table; and ids
answered with texts (detokenizing).

Which operation a request gets is said by its requested outputs, as Triton's clients say
what they want back. With the input ``text``: none, or any of ``input_ids``, ``lengths``
and ``hidden_states`` (``[N, D]``, every text's rows one after another; its datatype as
for ids, by a ``datatype`` parameter): embedding from text. Outputs among ``input_ids``,
``lengths``, ``offsets`` (``[N, 2]``) and ``special_tokens_mask`` (``[N]``, INT32) without
``hidden_states``: tokenizing. Two BOOL request parameters shape the tokenizing:
``add_special_tokens`` (default true) and ``truncate`` (default false: a text over the
model's limit is refused). With the input ``input_ids`` (INT64 or INT32, ``[B, S]``, or
``[N]`` with an input ``lengths`` ``[B]``) and the output ``texts`` (BYTES ``[B]``):
detokenizing, one text per sequence (BOOL parameter ``skip_special_tokens``, default
false).

The texts are in the request (``raw_input_contents``, each element a 4-byte little-endian
length and its bytes, as tritonclient serialises a BYTES tensor; or ``contents``'
``bytes_contents``), or in a shared-memory region of the caller's, serialised the same
way (``TextsInRegion``: the window's size is the serialised size, at most what a request
may carry, and it is read only once the request fits the model). Each output of texts
in may be written into a region of the caller's (``shm_service.TensorsSharedMemorySink``:
every size checked before anything is written; an output's size depends on the
tokenizing, so a region too small is refused once it is known, naming the sizes, with
nothing written; the response gives each output's shape). Detokenizing takes its ids in
the request and answers in it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tokembed.export.manifest import INPUT_NAME
from tokembed.server.core.dataplane import Request
from tokembed.server.core.dtypes import ID_DTYPES
from tokembed.server.core.errors import InvalidInput
from tokembed.server.core.operations.embed_request import Unread
from tokembed.server.core.operations.embed_text import EMBED_TEXT_OUTPUTS
from tokembed.server.core.operations.text_request import (
    HIDDEN_STATES,
    LENGTHS,
    TEXT,
    TEXTS,
    DetokenizeInput,
    TextInput,
    UnreadTexts,
)
from tokembed.server.core.operations.tokenize import TOKENIZE_OUTPUTS
from tokembed.server.core.texts_answer import TEXT_DTYPE, TextsAnswer
from tokembed.server.core.types import Answer, NamedTensor
from tokembed.server.edge.v2.parameters import bool_parameter, string_parameter
from tokembed.v2 import grpc_service_pb2 as pb

BYTES = "BYTES"
ADD_SPECIAL_TOKENS = "add_special_tokens"
TRUNCATE = "truncate"
SKIP_SPECIAL_TOKENS = "skip_special_tokens"
DATATYPE_PARAMETER = "datatype"
SHARED_MEMORY_REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
_ELEMENT_HEADER = 4  # a BYTES element's little-endian length


def is_text(request: pb.ModelInferRequest) -> bool:
    """Whether the request sends texts (an input ``text``, or any BYTES input)."""
    return any(tensor.name == TEXT or tensor.datatype == BYTES for tensor in request.inputs)


def asks_texts(request: pb.ModelInferRequest) -> bool:
    """Whether the request asks for texts back (the output ``texts``): detokenizing."""
    return any(output.name == TEXTS for output in request.outputs)


RequestedOutput = pb.ModelInferRequest.InferRequestedOutputTensor


@dataclass(slots=True)
class TextCall(Request[TextInput]):
    """A ModelInferRequest of texts, translated: ``tokenize`` says which operation (else
    embedding from text); ``outputs``: those asked for (their parameters say whether one
    goes into a region)."""

    tokenize: bool = False
    outputs: tuple[RequestedOutput, ...] = ()


@dataclass(slots=True)
class DetokenizeCall(Request[DetokenizeInput]):
    """A ModelInferRequest of ids asking for ``texts``."""


class TextsInRegion(UnreadTexts):
    """A ``text`` input in a shared-memory region: ``count`` BYTES elements serialised
    as tritonclient serialises them, in a window of ``nbytes``. ``source``: the window,
    read when the data plane asks (``shm_service.InRegion``, told its caller by the
    servicer)."""

    __slots__ = ("_count", "source")

    def __init__(self, source: Unread, count: int) -> None:
        self.source = source
        self._count = count

    @property
    def count(self) -> int:
        return self._count

    async def read(self) -> list[bytes]:
        texts = bytes_elements(await self.source.read(), "shared-memory window")
        if len(texts) != self._count:
            raise InvalidInput(
                f"input {TEXT!r} holds {len(texts)} texts in its shared-memory window, but "
                f"its shape [{self._count}] says {self._count} (the window's "
                f"{BYTE_SIZE} must be the texts' serialised size)"
            )
        return texts


# Where a region's input is (``requests.InputSource``, unread); raises for a server that
# reads inputs from the request only.
Source = Callable[["pb.ModelInferRequest", int], "bytes | Unread"]


def text_call(
    request: pb.ModelInferRequest, output_dtypes: Mapping[str, str], source: Source, max_bytes: int
) -> TextCall:
    """The text request a ModelInferRequest asks for; raises ``EmbedError``
    (``output_dtypes``: V2 datatype names -> the server's; ``max_bytes``: what a request
    may carry, which bounds texts in a region as it bounds texts in the message)."""
    if len(request.inputs) != 1 or request.inputs[0].name != TEXT:
        names = [tensor.name for tensor in request.inputs]
        raise InvalidInput(
            f"a request of texts takes one input, {TEXT!r} (BYTES, [B]); this one has {names} "
            f"(ids go in {INPUT_NAME}, without {TEXT})"
        )
    tensor = request.inputs[0]
    if tensor.datatype != BYTES:
        raise InvalidInput(f"input {TEXT!r} datatype {tensor.datatype or '(none)'} must be BYTES")
    shape = list(tensor.shape)
    if len(shape) != 1 or shape[0] < 0:
        raise InvalidInput(f"input {TEXT!r} shape {shape} must be [B]: one text per element")
    texts: list[bytes] | TextsInRegion
    if SHARED_MEMORY_REGION in tensor.parameters:
        texts = _in_region(request, tensor, shape[0], source, max_bytes)
    elif request.raw_input_contents:
        if len(request.raw_input_contents) != 1:
            raise InvalidInput(
                f"the request has 1 input but {len(request.raw_input_contents)} "
                "raw_input_contents; send one raw content per input"
            )
        texts = bytes_elements(request.raw_input_contents[0])
    else:
        texts = list(tensor.contents.bytes_contents)
    if isinstance(texts, list) and len(texts) != shape[0]:
        raise InvalidInput(
            f"input {TEXT!r} holds {len(texts)} texts, but its shape {shape} says {shape[0]}"
        )
    asked = [output.name for output in request.outputs]
    known = (*TOKENIZE_OUTPUTS, HIDDEN_STATES)
    for output in request.outputs:
        if output.name not in known:
            raise InvalidInput(
                f"unexpected output {output.name!r}; a request of texts answers {', '.join(known)}"
            )
        if asked.count(output.name) > 1:
            raise InvalidInput(f"output {output.name!r} is requested twice")
    tokenize = bool(asked) and HIDDEN_STATES not in asked
    allowed = TOKENIZE_OUTPUTS if tokenize else EMBED_TEXT_OUTPUTS
    for name in asked:
        if name not in allowed:
            raise InvalidInput(
                f"output {name!r} comes with tokenizing (outputs without {HIDDEN_STATES}); "
                f"with {HIDDEN_STATES}, ask for {', '.join(EMBED_TEXT_OUTPUTS)}"
            )
    body = TextInput(
        texts, bool_parameter(request.parameters, ADD_SPECIAL_TOKENS, True),
        bool_parameter(request.parameters, TRUNCATE, False), _output_dtype(request, output_dtypes),
        tuple(asked),
    )  # fmt: skip
    return TextCall(
        request.model_name, request.model_version, body, request.id, tokenize,
        tuple(request.outputs),
    )  # fmt: skip


def _in_region(
    request: pb.ModelInferRequest,
    tensor: pb.ModelInferRequest.InferInputTensor,
    count: int,
    source: Source,
    max_bytes: int,
) -> TextsInRegion:
    """The texts of a region's window, unread: what its size declares is checked against
    the request's own limits here (the model's, before the read: ``read_texts``)."""
    if request.raw_input_contents:
        raise InvalidInput(
            f"input {TEXT!r} names a shared-memory region and has raw_input_contents too; send one"
        )
    # The source sees this input alone: its bytes are the region's.
    unread = source(pb.ModelInferRequest(inputs=[tensor]), 0)
    if isinstance(unread, bytes):
        raise InvalidInput(f"this is a bug: input {TEXT!r} in a region came back read")
    size = unread.nbytes
    if size is not None and size > max_bytes:
        raise InvalidInput(
            f"input {TEXT!r}: {BYTE_SIZE} {size} is over the {max_bytes} bytes a request "
            "may carry; split the texts"
        )
    if size is not None and size < _ELEMENT_HEADER * count:
        raise InvalidInput(
            f"input {TEXT!r}: {BYTE_SIZE} {size} cannot hold {count} texts (each is a "
            f"{_ELEMENT_HEADER}-byte length and its bytes: at least {_ELEMENT_HEADER * count})"
        )
    return TextsInRegion(unread, count)


def detokenize_call(request: pb.ModelInferRequest) -> DetokenizeCall:
    """A ModelInferRequest of ids asking for ``texts``, as a detokenize request; raises
    ``InvalidInput``."""
    for output in request.outputs:
        if output.name != TEXTS:
            raise InvalidInput(
                f"output {output.name!r} cannot come with {TEXTS!r}: detokenizing answers "
                f"{TEXTS} alone"
            )
        if SHARED_MEMORY_REGION in output.parameters:
            raise InvalidInput(f"output {TEXTS!r} names a shared-memory region; detokenized "
                               "texts come in the response")  # fmt: skip
    if len(request.outputs) > 1:
        raise InvalidInput(f"output {TEXTS!r} is requested twice")
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(
            f"the request has {len(request.inputs)} inputs but {len(raw)} raw_input_contents; "
            "send one raw content per input, in the inputs' order"
        )
    found: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for index, tensor in enumerate(request.inputs):
        if tensor.name not in (INPUT_NAME, LENGTHS):
            raise InvalidInput(f"unexpected input {tensor.name!r}; detokenizing takes "
                               f"{INPUT_NAME} (and {LENGTHS}, for ragged ids)")  # fmt: skip
        if tensor.name in found:
            raise InvalidInput(f"input {tensor.name!r} is given twice")
        if SHARED_MEMORY_REGION in tensor.parameters:
            raise InvalidInput(f"input {tensor.name!r} names a shared-memory region; send the "
                               "ids to detokenize in the request")  # fmt: skip
        dtype = _V2_ID_DTYPES.get(tensor.datatype)
        if dtype is None:
            raise InvalidInput(
                f"input {tensor.name!r} datatype {tensor.datatype or '(none)'} is not "
                f"supported; send {' or '.join(_V2_ID_DTYPES)}"
            )
        data = raw[index] if raw else _typed_ids(tensor, dtype)
        found[tensor.name] = (dtype, tuple(tensor.shape), data)
    if INPUT_NAME not in found:
        raise InvalidInput(f"input {INPUT_NAME!r} is missing: detokenizing takes the ids")
    dtype, shape, data = found[INPUT_NAME]
    lengths: tuple[int, ...] = ()
    if LENGTHS in found:
        lengths_dtype, lengths_shape, lengths_data = found[LENGTHS]
        itemsize = ID_DTYPES[lengths_dtype].itemsize
        if len(lengths_shape) != 1 or len(lengths_data) != lengths_shape[0] * itemsize:
            raise InvalidInput(
                f"input {LENGTHS!r} shape {list(lengths_shape)} must be [B], with its "
                f"{lengths_shape[0] if lengths_shape else 0} values in its contents"
            )
        if not lengths_shape[0]:
            raise InvalidInput(f"input {LENGTHS!r} is empty; send one length per sequence")
        fmt = "<" + ("q" if itemsize == 8 else "i") * lengths_shape[0]
        lengths = struct.unpack(fmt, lengths_data)
    body = DetokenizeInput(
        dtype, shape, data, lengths, bool_parameter(request.parameters, SKIP_SPECIAL_TOKENS)
    )
    return DetokenizeCall(request.model_name, request.model_version, body, request.id)


_V2_ID_DTYPES = {dtype.v2: dtype.name for dtype in ID_DTYPES.values()}


def _typed_ids(tensor: pb.ModelInferRequest.InferInputTensor, dtype: str) -> bytes:
    contents = tensor.contents
    if ID_DTYPES[dtype].itemsize == 8:
        return struct.pack(f"<{len(contents.int64_contents)}q", *contents.int64_contents)
    return struct.pack(f"<{len(contents.int_contents)}i", *contents.int_contents)


def bytes_elements(raw: bytes, where: str = "raw content") -> list[bytes]:
    """A BYTES tensor's raw content (or a shared-memory window's: ``where``): each element
    a 4-byte little-endian length, then its bytes (Triton's serialisation)."""
    elements: list[bytes] = []
    offset, size = 0, len(raw)
    while offset < size:
        if size - offset < 4:
            raise InvalidInput(
                f"input {TEXT!r} {where} ends in {size - offset} byte(s), short of an "
                "element's 4-byte length"
            )
        (length,) = _LENGTH.unpack_from(raw, offset)
        offset += 4
        if length > size - offset:
            raise InvalidInput(
                f"input {TEXT!r} element {len(elements)} claims {length} bytes, but "
                f"{size - offset} remain in its {where}"
            )
        elements.append(raw[offset : offset + length])
        offset += length
    return elements


_LENGTH = struct.Struct("<I")


def _output_dtype(request: pb.ModelInferRequest, output_dtypes: Mapping[str, str]) -> str:
    asked = ""
    for parameters in [output.parameters for output in request.outputs] + [request.parameters]:
        asked = asked or string_parameter(parameters, DATATYPE_PARAMETER)
    if not asked:
        return "float32"
    dtype = output_dtypes.get(asked)
    if dtype is None:
        raise InvalidInput(
            f"datatype {asked} is not supported for {HIDDEN_STATES}; ask for "
            f"{' or '.join(output_dtypes)}"
        )
    return dtype


# --- answers


def as_tensors(answer: Answer) -> Answer:
    """An answer as V2 frames it: texts (detokenizing's) become the BYTES output
    ``texts`` ``[B]``, each element its length and its UTF-8 bytes; others are as they
    are."""
    if not isinstance(answer, TextsAnswer):
        return answer
    parts: list[bytes] = []
    for text in answer.texts:
        encoded = text.encode("utf-8")
        parts += [_LENGTH.pack(len(encoded)), encoded]
    serialised = b"".join(parts)
    tensor = NamedTensor(TEXTS, (len(answer.texts),), TEXT_DTYPE, [serialised], len(serialised))
    return Answer.of_tensors(
        [tensor], answer.timings, answer.tokens, answer.model_name, answer.model_version
    )
