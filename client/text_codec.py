"""The text calls' requests (Tokenize, Detokenize, EmbedText) and their answers.

Texts go as UTF-8 bytes (a ``bytes`` item is sent as it is: the server says whether it is
UTF-8). An answer of named tensors (``TensorsResponse``) is parsed by protobuf's C parser
and each tensor viewed as an array of its bytes (``decode.frombuffer``: sizes checked).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tokembed.client import codec, decode
from tokembed.client.errors import client_invalid_input, protocol_error
from tokembed.client.results import TextEmbedResult, Timings, TokenizeResult
from tokembed.v1 import embedding_pb2 as pb


def texts_of(texts: str | bytes | Sequence[str | bytes]) -> list[bytes]:
    """One text, or several, as the request's bytes."""
    if isinstance(texts, (str, bytes)):
        texts = [texts]
    encoded = []
    for index, text in enumerate(texts):
        if isinstance(text, str):
            encoded.append(text.encode("utf-8", "surrogatepass"))
        elif isinstance(text, bytes):
            encoded.append(text)
        else:
            raise client_invalid_input(
                f"texts[{index}] is a {type(text).__name__}; texts are str (or UTF-8 bytes)"
            )
    return encoded


def _truncation(truncation: bool) -> pb.Truncation.ValueType:
    return pb.TRUNCATION_TRUNCATE if truncation else pb.TRUNCATION_REFUSE


def tokenize_request(
    texts: Any, add_special_tokens: bool, truncation: bool, model_name: str, request_id: str
) -> pb.TokenizeRequest:
    return pb.TokenizeRequest(
        texts=texts_of(texts), add_special_tokens=add_special_tokens,
        truncation=_truncation(truncation), model_name=model_name, request_id=request_id,
    )  # fmt: skip


def embed_text_request(
    texts: Any,
    dtype: Any,
    add_special_tokens: bool,
    truncation: bool,
    model_name: str,
    request_id: str,
) -> pb.EmbedTextRequest:
    return pb.EmbedTextRequest(
        texts=texts_of(texts), add_special_tokens=add_special_tokens,
        truncation=_truncation(truncation), output_dtype=codec.output_dtype_code(dtype),
        model_name=model_name, request_id=request_id,
    )  # fmt: skip


def detokenize_request(
    ids: Any, skip_special_tokens: bool, model_name: str, request_id: str
) -> pb.DetokenizeRequest:
    """Ids as a 2-D array ``[B, S]``, one sequence (1-D), or sequences of any lengths."""
    if isinstance(ids, np.ndarray) and ids.ndim == 2:
        array, lengths = ids, None
    elif isinstance(ids, np.ndarray) and ids.ndim == 1:
        array, lengths = ids, [len(ids)]
    else:
        sequences = list(ids)
        if sequences and not isinstance(sequences[0], (Sequence, np.ndarray)):
            sequences = [sequences]  # one sequence of ints
        lengths = [len(sequence) for sequence in sequences]
        flat = [int(value) for sequence in sequences for value in sequence]
        array = np.asarray(flat, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise client_invalid_input(f"ids must be integers, got {array.dtype}")
    array = np.ascontiguousarray(array, dtype="<i8")
    return pb.DetokenizeRequest(
        input_ids=pb.Tensor(dtype=pb.DTYPE_INT64, shape=array.shape, data=array.tobytes()),
        lengths=lengths or [], skip_special_tokens=skip_special_tokens,
        model_name=model_name, request_id=request_id,
    )  # fmt: skip


def _needed(tensors: dict[str, Any], name: str) -> Any:
    if name not in tensors:
        raise protocol_error(f"the answer has no tensor {name!r} (it has {sorted(tensors)})")
    return tensors[name]


def tokenize_result(raw: bytes) -> TokenizeResult:
    tensors, response = decode.named_tensors(raw)
    return TokenizeResult(
        input_ids=_needed(tensors, "input_ids"),
        lengths=_needed(tensors, "lengths"),
        offsets=_needed(tensors, "offsets"),
        special_tokens_mask=_needed(tensors, "special_tokens_mask").astype(bool),
        timings=Timings.from_proto(response.timings),
        model_name=response.model_name,
        model_version=response.model_version,
        request_id=response.request_id,
    )


def embed_text_result(raw: bytes) -> TextEmbedResult:
    return embed_text_result_of(*decode.named_tensors(raw))


def embed_text_result_of(tensors: dict[str, Any], response: pb.TensorsResponse) -> TextEmbedResult:
    """An EmbedText answer's tensors by name (from a TensorsResponse, or an
    EmbedTextChunked reply reassembled) and the response around them, to its result."""
    return TextEmbedResult(
        hidden_states=_needed(tensors, "hidden_states"),
        input_ids=_needed(tensors, "input_ids"),
        lengths=_needed(tensors, "lengths"),
        timings=Timings.from_proto(response.timings),
        model_name=response.model_name,
        model_version=response.model_version,
        request_id=response.request_id,
    )
