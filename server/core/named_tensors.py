"""Answers made of several named tensors (text in: ids, lengths, offsets, vectors), and
answers made of texts (ids in: Detokenize).

Both are ``Answer``s, so that the data plane, the scheduler and the calls' records take
them as they take an embed answer: ``shape``, ``dtype`` and ``pieces`` are those of the
answer's first tensor (what the logs name), ``nbytes`` and ``tokens`` the whole answer's.
Each protocol frames the tensors once (``edge/v1/responses``' ``tensors_response``,
``edge/v2/responses``' ``tensors_infer_response``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokembed.server.core.dtypes import DType
from tokembed.server.core.types import Answer, Buffer, Timings

# What a texts answer's ``dtype`` is called (the V2 name of a tensor of strings).
TEXT_DTYPE = DType("bytes", 1, 8, "BYTES", "object")


@dataclass(slots=True)
class NamedTensor:
    """One tensor of an answer: C-order bytes of ``shape`` and ``dtype``, as pieces."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    pieces: Sequence[Buffer]
    nbytes: int


@dataclass(slots=True)
class TensorsAnswer(Answer):
    """An answer of several named tensors, in the order they are framed."""

    tensors: tuple[NamedTensor, ...] = ()

    @classmethod
    def of(
        cls,
        tensors: Sequence[NamedTensor],
        timings: Timings,
        tokens: int,
        model_name: str,
        model_version: str,
    ) -> TensorsAnswer:
        first = tensors[0]
        return cls(
            first.shape, first.dtype, first.pieces, None, timings, tokens,
            sum(tensor.nbytes for tensor in tensors), model_name, model_version, tuple(tensors),
        )  # fmt: skip


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
            tuple(texts),
        )
