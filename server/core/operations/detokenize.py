"""The detokenize operation: ids in (``[B, S]``, or ``[N]`` with ``lengths``), one text
per sequence out, decoded by the model's own tokenizer on a worker thread (``off_loop``).
Ids are checked against the tokenizer's vocabulary first: the library would refuse one
past it with a message of its own, or skip it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokembed.server.backends.base import Backend
from tokembed.server.backends.tokenizer import TextTokenizer
from tokembed.server.core.errors import InvalidInput
from tokembed.server.core.operations.base import Operation
from tokembed.server.core.operations.embed_request import check_data_size, check_tokens, ids_dtype
from tokembed.server.core.operations.text_request import DetokenizeInput, tokenizer_of
from tokembed.server.core.served import ServedModel
from tokembed.server.core.texts_answer import TextsAnswer
from tokembed.server.core.types import Answer, Timings


@dataclass(slots=True)
class DetokenizeJob:
    sequences: list[list[int]]
    tokenizer: TextTokenizer
    skip_special_tokens: bool
    tokens: int

    @property
    def output_bytes(self) -> int:
        return self.tokens * 16  # a token decodes to a few bytes of text


class Detokenize(Operation[DetokenizeInput, DetokenizeJob, list[str]]):
    name = "detokenize"
    off_loop = True

    def validate(self, request: DetokenizeInput, model: ServedModel) -> DetokenizeJob:
        tokenizer = tokenizer_of(model)
        dtype = ids_dtype("input_ids", request.ids_dtype)
        shape = request.shape
        if request.lengths:
            if len(shape) != 1:
                raise InvalidInput(
                    f"input_ids shape {list(shape)} must be [N] (flat) when lengths are given"
                )
            if min(request.lengths) < 0 or sum(request.lengths) != shape[0]:
                raise InvalidInput(
                    f"lengths {list(request.lengths)} must be >= 0 and sum to the {shape[0]} "
                    "ids of input_ids"
                )
            lengths = list(request.lengths)
        elif len(shape) == 2 and min(shape) >= 0:
            lengths = [shape[1]] * shape[0]
        else:
            raise InvalidInput(
                f"input_ids shape {list(shape)} must be [B, S] (or [N] with lengths)"
            )
        tokens = sum(lengths)
        check_data_size("input_ids", request.data, shape, dtype, tokens)
        check_tokens(tokens, model)
        ids = np.frombuffer(request.data, dtype=dtype.numpy)
        bad = np.flatnonzero((ids < 0) | (ids >= tokenizer.vocab_size))
        if bad.size:
            first = int(bad[0])
            raise InvalidInput(
                f"input_ids[{first}] = {int(ids[first])} is outside the tokenizer's "
                f"vocabulary [0, {tokenizer.vocab_size})"
            )
        values = ids.tolist()
        sequences, start = [], 0
        for length in lengths:
            sequences.append(values[start : start + length])
            start += length
        return DetokenizeJob(sequences, tokenizer, request.skip_special_tokens, tokens)

    def compute(self, backend: Backend, jobs: Sequence[DetokenizeJob]) -> list[list[str]]:
        return [
            job.tokenizer.decode(job.sequences, skip_special_tokens=job.skip_special_tokens)
            for job in jobs
        ]

    def answer(
        self, job: DetokenizeJob, result: list[str], timings: Timings, model: ServedModel
    ) -> Answer:
        return TextsAnswer.of(result, timings, job.tokens, model.name, model.version)


DETOKENIZE = Detokenize()
