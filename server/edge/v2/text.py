"""Text through the Open Inference Protocol: a ``ModelInferRequest`` whose input is
``text`` (BYTES, shape ``[B]``: one UTF-8 text per element), answered by the model's own
tokenizer, then, unless only the tokenizer's outputs are asked for, by its table.

Which operation a text request gets is said by its requested outputs, as Triton's clients
say what they want back: none, or any of ``input_ids``, ``lengths`` and ``hidden_states``
(``[N, D]``, every text's rows one after another; its datatype as for ids, by a
``datatype`` parameter): embedding from text. Outputs among ``input_ids``, ``lengths``,
``offsets`` (``[N, 2]``) and ``special_tokens_mask`` (``[N]``, INT32) without
``hidden_states``: tokenizing. Two BOOL request parameters shape the tokenizing:
``add_special_tokens`` (default true) and ``truncate`` (default false: a text over the
model's limit is refused).

The texts are in the request (``raw_input_contents``, each element a 4-byte little-endian
length and its bytes, as tritonclient serialises a BYTES tensor; or ``contents``'
``bytes_contents``); a region holding them, or an answer asked into one, is refused.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass

from tokembed.export.manifest import INPUT_NAME
from tokembed.server.core.dataplane import Request
from tokembed.server.core.errors import InvalidInput
from tokembed.server.core.operations.embed_text import EMBED_TEXT_OUTPUTS
from tokembed.server.core.operations.text_request import HIDDEN_STATES, TEXT, TextInput
from tokembed.server.core.operations.tokenize import TOKENIZE_OUTPUTS
from tokembed.server.edge.v2.parameters import bool_parameter, string_parameter
from tokembed.v2 import grpc_service_pb2 as pb

BYTES = "BYTES"
ADD_SPECIAL_TOKENS = "add_special_tokens"
TRUNCATE = "truncate"
DATATYPE_PARAMETER = "datatype"
SHARED_MEMORY_REGION = "shared_memory_region"


def is_text(request: pb.ModelInferRequest) -> bool:
    """Whether the request sends texts (an input ``text``, or any BYTES input)."""
    return any(tensor.name == TEXT or tensor.datatype == BYTES for tensor in request.inputs)


@dataclass(slots=True)
class TextCall(Request[TextInput]):
    """A ModelInferRequest of texts, translated: ``tokenize`` says which operation (else
    embedding from text)."""

    tokenize: bool = False


def text_call(request: pb.ModelInferRequest, output_dtypes: Mapping[str, str]) -> TextCall:
    """The text request a ModelInferRequest asks for; raises ``EmbedError``
    (``output_dtypes``: V2 datatype names -> the server's)."""
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
    if SHARED_MEMORY_REGION in tensor.parameters:
        raise InvalidInput(
            f"input {TEXT!r} names a shared-memory region; send texts in the request"
        )
    if request.raw_input_contents:
        if len(request.raw_input_contents) != 1:
            raise InvalidInput(
                f"the request has 1 input but {len(request.raw_input_contents)} "
                "raw_input_contents; send one raw content per input"
            )
        texts = bytes_elements(request.raw_input_contents[0])
    else:
        texts = list(tensor.contents.bytes_contents)
    if len(texts) != shape[0]:
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
        if SHARED_MEMORY_REGION in output.parameters:
            raise InvalidInput(
                f"output {output.name} names a shared-memory region; answers to texts come in "
                "the response"
            )
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
    return TextCall(request.model_name, request.model_version, body, request.id, tokenize)


def bytes_elements(raw: bytes) -> list[bytes]:
    """A BYTES tensor's raw content: each element a 4-byte little-endian length, then its
    bytes (Triton's serialisation)."""
    elements: list[bytes] = []
    offset, size = 0, len(raw)
    while offset < size:
        if size - offset < 4:
            raise InvalidInput(
                f"input {TEXT!r} raw content ends in {size - offset} byte(s), short of an "
                "element's 4-byte length"
            )
        (length,) = _LENGTH.unpack_from(raw, offset)
        offset += 4
        if length > size - offset:
            raise InvalidInput(
                f"input {TEXT!r} element {len(elements)} claims {length} bytes, but "
                f"{size - offset} remain in its raw content"
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


# --- answers: ModelInferResponse fields 5 (outputs) and 6 (raw_output_contents)


def stream_refusal() -> InvalidInput:
    return InvalidInput(
        f"ModelStreamInfer takes ids; send texts ({TEXT!r}) to ModelInfer, one request each"
    )
