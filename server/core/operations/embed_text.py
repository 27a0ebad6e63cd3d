"""Embedding from text: texts in; ``input_ids [N]``, ``lengths [B]`` and
``hidden_states [N, D]`` out (every text's rows one after another, in the dtype asked),
the texts tokenized by the model's own tokenizer and their ids looked up as Embed's are.

One worker thread does both (``off_loop``): the batch encode, then the look-up of all the
request's ids at once on the model's backend (a further id input of the model's kind, a
segment model's ``token_type_ids``, is 0s, as for Embed when it is not sent).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokembed.server.backends.base import Backend, LookUp, Rows
from tokembed.server.backends.tokenizer import Encoded
from tokembed.server.core.dtypes import INT64, OUTPUT_DTYPES
from tokembed.server.core.errors import Internal, TooLarge
from tokembed.server.core.operations.base import Operation
from tokembed.server.core.operations.embed import within_bound
from tokembed.server.core.operations.text_request import (
    HIDDEN_STATES,
    INPUT_IDS,
    LENGTHS,
    TextInput,
    answer_dtype,
    read_texts,
    texts_unread,
)
from tokembed.server.core.operations.tokenize import TextJob, text_job, token_tensors
from tokembed.server.core.served import ServedModel
from tokembed.server.core.types import Answer, NamedTensor, Timings, TokenIds

EMBED_TEXT_OUTPUTS = (INPUT_IDS, LENGTHS, HIDDEN_STATES)


@dataclass(slots=True)
class TextRows:
    encoded: Encoded
    rows: Rows


@dataclass(slots=True)
class EmbedTextJob:
    """Validated texts (``TextJob``), and the dtype of their vectors."""

    text: TextJob
    output_dtype_name: str

    @property
    def tokens(self) -> int:
        return self.text.tokens

    @property
    def output_bytes(self) -> int:
        return self.text.output_bytes


class EmbedText(Operation[TextInput, EmbedTextJob, TextRows]):
    name = "embed_text"
    off_loop = True

    def unread(self, request: TextInput) -> bool:
        return texts_unread(request)

    async def read(self, request: TextInput, model: ServedModel) -> TextInput:
        return await read_texts(request, model, EMBED_TEXT_OUTPUTS, output_dtype=True)

    def validate(self, request: TextInput, model: ServedModel) -> EmbedTextJob:
        dtype = answer_dtype(request.output_dtype)
        job = text_job(request, model, EMBED_TEXT_OUTPUTS, model.d_model * dtype.itemsize + 16)
        return EmbedTextJob(job, dtype.name)

    def compute(self, backend: Backend, jobs: Sequence[EmbedTextJob]) -> list[TextRows]:
        results = []
        for job in jobs:
            encoded, tokens = job.text.encode(details=False)
            ids = TokenIds(encoded.ids.tobytes(), INT64, tokens)
            model = job.text.model
            if tokens and not within_bound(ids, model.vocab_size):
                raise Internal(
                    f"this is a bug: the tokenizer of {model.name!r} gave an id past its "
                    f"{model.vocab_size} rows (the loader checks its vocabulary)"
                )
            dtype = OUTPUT_DTYPES[job.output_dtype_name]
            size = tokens * model.d_model * dtype.itemsize
            limit = model.limits.max_output_bytes_per_request
            if size > limit:
                raise TooLarge(
                    f"hidden_states would be {size} bytes ({tokens} tokens x {model.d_model} x "
                    f"{dtype.name}), over the limit of {limit} bytes per request; split the "
                    "texts or ask for float16"
                )
            rows = backend.look_up(LookUp(ids, dtype)) if tokens else _NO_ROWS
            results.append(TextRows(encoded, rows))
        return results

    def answer(
        self, job: EmbedTextJob, result: TextRows, timings: Timings, model: ServedModel
    ) -> Answer:
        encoded, rows = result.encoded, result.rows
        tokens = len(encoded.ids)
        if len(rows) != tokens:
            raise Internal(f"this is a bug: the look-up gave {len(rows)} rows for {tokens} ids")
        dtype = OUTPUT_DTYPES[job.output_dtype_name]
        tensors = token_tensors(encoded, job.text.outputs)
        if HIDDEN_STATES in job.text.outputs:
            pieces = rows.pieces(0, tokens) if tokens else []
            size = tokens * model.d_model * dtype.itemsize
            shape = (tokens, model.d_model)
            tensors.append(NamedTensor(HIDDEN_STATES, shape, dtype, pieces, size))
        order = {name: index for index, name in enumerate(job.text.outputs)}
        tensors.sort(key=lambda tensor: order[tensor.name])
        return Answer.of_tensors(tensors, timings, tokens, model.name, model.version)


class _NoRows(Rows):
    """The rows of no ids (texts that tokenized to nothing)."""

    def pieces(self, start: int, stop: int) -> list[bytes]:
        return []

    def __len__(self) -> int:
        return 0


_NO_ROWS = _NoRows()
EMBED_TEXT = EmbedText()
