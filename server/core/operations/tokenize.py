"""The tokenize operation: texts in; ``input_ids [N]``, ``lengths [B]``, ``offsets [N, 2]``
and ``special_tokens_mask [N]`` out (every text's tokens one after another), with the
model's own tokenizer (``backends.tokenizer``).

A request's texts are one batch encode, on a worker thread (``off_loop``): the event loop
never waits for a tokenizer, however many texts a request holds. Each request is a batch
of its own (its texts are the library's batch), so requests are never batched together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokembed.server.backends.base import Backend, byte_view
from tokembed.server.backends.tokenizer import Encoded, TextTokenizer
from tokembed.server.core.dtypes import INT32, INT64
from tokembed.server.core.operations.base import Operation
from tokembed.server.core.operations.text_request import (
    INPUT_IDS,
    LENGTHS,
    OFFSETS,
    SPECIAL_TOKENS_MASK,
    TextInput,
    check_lengths,
    decoded_texts,
    estimated_tokens,
    in_hand,
    read_texts,
    texts_unread,
    tokenizer_of,
    wanted,
)
from tokembed.server.core.served import ServedModel
from tokembed.server.core.types import Answer, NamedTensor, Timings

TOKENIZE_OUTPUTS = (INPUT_IDS, LENGTHS, OFFSETS, SPECIAL_TOKENS_MASK)


@dataclass(slots=True)
class TextJob:
    """Validated texts, and the model that tokenizes them."""

    texts: list[str]
    tokenizer: TextTokenizer
    model: ServedModel
    add_special_tokens: bool
    truncate: bool
    outputs: tuple[str, ...]
    # An estimate until tokenized (``estimated_tokens``: what admission counted), the
    # texts' tokens after (what the answer's timings report).
    tokens: int
    output_bytes: int

    def encode(self, details: bool = True) -> tuple[Encoded, int]:
        """The texts tokenized, and their tokens (within the limits, or ``TooLarge``);
        ``details``: with the tokens' offsets and special marks."""
        encoded = self.tokenizer.encode(
            self.texts, add_special_tokens=self.add_special_tokens, truncate=self.truncate,
            details=details,
        )  # fmt: skip
        self.tokens = check_lengths(encoded.lengths.tolist(), self.tokenizer, self.model)
        return encoded, self.tokens


def text_job(
    request: TextInput, model: ServedModel, known: Sequence[str], row_bytes: int
) -> TextJob:
    """``request`` as a job (``row_bytes``: what each token's answer costs)."""
    tokenizer = tokenizer_of(model)
    outputs = wanted(request.outputs, known)
    sent = in_hand(request.texts)
    texts = decoded_texts(sent)
    tokens = estimated_tokens(sent, tokenizer.max_length, request.truncate)
    return TextJob(
        texts, tokenizer, model, request.add_special_tokens, request.truncate, outputs,
        tokens, min(tokens * row_bytes, model.limits.max_output_bytes_per_request),
    )  # fmt: skip


def token_tensors(encoded: Encoded, outputs: tuple[str, ...]) -> list[NamedTensor]:
    """The tokenizer's tensors of an answer, those asked for, in ``outputs``' order."""
    arrays = {
        INPUT_IDS: (encoded.ids, INT64),
        LENGTHS: (encoded.lengths, INT64),
        OFFSETS: (encoded.offsets, INT64),
        SPECIAL_TOKENS_MASK: (encoded.special, INT32),
    }
    tensors = []
    for name in outputs:
        array, dtype = arrays.get(name, (None, INT64))
        if array is not None:
            tensors.append(NamedTensor(name, array.shape, dtype, [byte_view(array)], array.nbytes))
    return tensors


class Tokenize(Operation[TextInput, TextJob, Encoded]):
    name = "tokenize"
    off_loop = True

    def unread(self, request: TextInput) -> bool:
        return texts_unread(request)

    async def read(self, request: TextInput, model: ServedModel) -> TextInput:
        return await read_texts(request, model, TOKENIZE_OUTPUTS)

    def validate(self, request: TextInput, model: ServedModel) -> TextJob:
        return text_job(request, model, TOKENIZE_OUTPUTS, 8 * 4)

    def compute(self, backend: Backend, jobs: Sequence[TextJob]) -> list[Encoded]:
        return [job.encode()[0] for job in jobs]

    def answer(self, job: TextJob, result: Encoded, timings: Timings, model: ServedModel) -> Answer:
        return Answer.of_tensors(
            token_tensors(result, job.outputs), timings, len(result.ids), model.name,
            model.version,
        )  # fmt: skip


TOKENIZE = Tokenize()
