"""Answers made of texts (ids in: Detokenize). An ``Answer``, so that the data plane, the
scheduler and the calls' records take it as they take an embed answer. (Answers of several
named tensors, text in's ids, lengths, offsets and vectors among them, are ``Answer``s
with ``tensors``: ``core/types``.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokembed.server.core.dtypes import DType
from tokembed.server.core.types import Answer, Timings

# What a texts answer's ``dtype`` is called (the V2 name of a tensor of strings).
TEXT_DTYPE = DType("bytes", 1, 8, "BYTES", "object")


@dataclass(slots=True)
class TextsAnswer(Answer):
    """An answer of texts, one per sequence asked about."""

    texts: tuple[str, ...] = ()

    @classmethod
    def of(
        cls, texts: Sequence[str], timings: Timings, tokens: int, model_name: str, version: str
    ) -> TextsAnswer:
        size = sum(len(text) for text in texts)
        return cls(
            (len(texts),),
            TEXT_DTYPE,
            (),
            None,
            timings,
            tokens,
            size,
            model_name,
            version,
            texts=tuple(texts),
        )
