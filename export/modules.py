"""The torch modules of the model kinds: what their exported graphs are proved against,
computed as the libraries that define them compute. Each maps ``[B,S]`` int64 ids to
``[B,S,D]`` float32.

- ``TokenEmbedding``: a Transformer's input-embedding layer, ``E[id] * scale``.
- ``SegmentEmbedding``: BERT's ``BertEmbeddings`` up to its positions and LayerNorm,
  ``word_embeddings(input_ids) + token_type_embeddings(token_type_ids)`` (Hugging Face
  ``transformers``), the word rows scaled first when the manifest's scale is not 1.
- ``FactorizedEmbedding``: ALBERT's ``word_embeddings`` ``[V, D']`` then the encoder's
  ``embedding_hidden_mapping_in`` (``nn.Linear(D', D)``), the rows scaled before the
  projection when the scale is not 1. (ALBERT itself adds token types and positions and
  normalises between the two; the source's layer is the look-up and its projection.)

A given table is adopted as float32 and kept as it is (padding row included): the module
must compute what the checkpoint computes.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokembed.export.errors import ExportError


def resolve_scale(scale: str | float, d_model: int) -> float:
    """``"sqrt"`` is the original Transformer's sqrt(D); ``"none"`` is 1; else a positive float."""
    if isinstance(scale, str):
        text = scale.strip().lower()
        if text == "sqrt":
            return math.sqrt(d_model)
        if text == "none":
            return 1.0
        try:
            value = float(text)
        except ValueError:
            raise ExportError(
                f"--scale must be 'sqrt', 'none' or a positive number, got {scale!r}"
            ) from None
    else:
        value = float(scale)
    if not (math.isfinite(value) and value > 0):
        raise ExportError(f"--scale must be a positive number, got {scale!r}")
    return value


def check_table_sizes(vocab_size: int, d_model: int, padding_idx: int | None) -> None:
    """A ``[V, D]`` table's sizes and its padding id, before anything is built from them."""
    if vocab_size <= 0:
        raise ExportError(f"vocab size must be positive, got {vocab_size}")
    if d_model <= 0:
        raise ExportError(f"d_model must be positive, got {d_model}")
    _check_padding(padding_idx, vocab_size)


def _check_padding(padding_idx: int | None, vocab_size: int) -> None:
    if padding_idx is not None and not 0 <= padding_idx < vocab_size:
        raise ExportError(f"padding id {padding_idx} is outside [0, {vocab_size})")


class TokenEmbedding(nn.Module):
    """The input-embedding layer of a Transformer.

    ``scale`` defaults to sqrt(d_model). ``padding_idx`` behaves as in ``nn.Embedding``:
    its row starts as zeros (and receives no gradient). A given ``weight`` is adopted, not
    copied (the module shares its storage when it is already float32), and kept as it
    is: its padding row is not zeroed, since the module must compute what the checkpoint
    computes.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        scale: str | float = "sqrt",
        padding_idx: int | None = None,
        weight: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        check_table_sizes(vocab_size, d_model, padding_idx)
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.scale = resolve_scale(scale, d_model)
        self.padding_idx = padding_idx
        if weight is None:
            self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=padding_idx)
        else:
            if tuple(weight.shape) != (vocab_size, d_model):
                raise ExportError(
                    f"weight is {list(weight.shape)}, expected [{vocab_size}, {d_model}]"
                )
            # Adopt the table instead of initialising a random one and copying over it:
            # for a multi-GB table that saves one full copy in memory and seconds of
            # random init. The given rows are kept as they are, padding row included.
            # ``_weight`` is what ``nn.Embedding.from_pretrained`` passes (that method is
            # untyped, so mypy --strict refuses the call); it does not zero the padding row.
            self.embedding = nn.Embedding(
                vocab_size,
                d_model,
                padding_idx=padding_idx,
                _weight=weight.detach().to(torch.float32),
            )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        scaled: torch.Tensor = self.embedding(input_ids) * self.scale
        return scaled


def random_table(vocab_size: int, d_model: int, seed: int, padding_idx: int | None) -> torch.Tensor:
    """The seeded table ``nn.Embedding`` would initialise: N(0, 1), padding row zero."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab_size, d_model, generator=generator, dtype=torch.float32)
    if padding_idx is not None:
        table[padding_idx].zero_()
    return table


def _float_table(what: str, table: torch.Tensor) -> torch.Tensor:
    if table.dim() != 2 or not table.is_floating_point():
        raise ExportError(
            f"{what} must be a 2-D float matrix, got {table.dtype}{list(table.shape)}"
        )
    return table.detach().to(torch.float32)


class SegmentEmbedding(nn.Module):
    """``E[id] * scale + S[t]``: ``embedding [V, D]``, ``segment [T, D]``."""

    vocab_size: int
    d_model: int
    type_vocab_size: int
    scale: float
    padding_idx: int | None

    def __init__(
        self,
        embedding: torch.Tensor,
        segment: torch.Tensor,
        scale: str | float = "none",
        padding_idx: int | None = None,
    ) -> None:
        super().__init__()
        words = _float_table("the embedding table", embedding)
        types = _float_table("the segment table", segment)
        vocab_size, d_model = (int(n) for n in words.shape)
        if types.shape[1] != d_model:
            raise ExportError(
                f"the segment table is {list(types.shape)}, but the embedding table is "
                f"{list(words.shape)}: both need D={d_model} columns"
            )
        _check_padding(padding_idx, vocab_size)
        self.vocab_size, self.d_model = vocab_size, d_model
        self.type_vocab_size = int(types.shape[0])
        self.scale = resolve_scale(scale, d_model)
        self.padding_idx = padding_idx
        # _weight adopts the tensor (nn.Embedding.from_pretrained is untyped for mypy).
        self.word_embeddings = nn.Embedding(
            vocab_size, d_model, padding_idx=padding_idx, _weight=words
        )
        self.token_type_embeddings = nn.Embedding(self.type_vocab_size, d_model, _weight=types)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        words: torch.Tensor = self.word_embeddings(input_ids)
        if self.scale != 1.0:
            words = words * self.scale
        out: torch.Tensor = words + self.token_type_embeddings(token_type_ids)
        return out


class FactorizedEmbedding(nn.Module):
    """``P(E[id] * scale)``: ``embedding [V, D']`` and a ``Linear(D', D)`` whose weight is
    ``projection [D, D']`` (torch's layout) and whose bias is ``bias [D]`` or none."""

    vocab_size: int
    factor_dim: int
    d_model: int
    scale: float
    padding_idx: int | None

    def __init__(
        self,
        embedding: torch.Tensor,
        projection: torch.Tensor,
        bias: torch.Tensor | None = None,
        scale: str | float = "none",
        padding_idx: int | None = None,
    ) -> None:
        super().__init__()
        words = _float_table("the embedding table", embedding)
        weight = _float_table("the projection", projection)
        vocab_size, inner = (int(n) for n in words.shape)
        d_model = int(weight.shape[0])
        if weight.shape[1] != inner:
            raise ExportError(
                f"the projection is {list(weight.shape)} ([D, D'] as a torch Linear holds it), "
                f"but the embedding table is {list(words.shape)}: its D' is {inner}"
            )
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != d_model):
            raise ExportError(
                f"the projection's bias is {list(bias.shape)}, expected [{d_model}] (its D)"
            )
        _check_padding(padding_idx, vocab_size)
        self.vocab_size, self.factor_dim, self.d_model = vocab_size, inner, d_model
        # ALBERT's scale is 1; "sqrt" is the original Transformer's sqrt(D), D the model's
        # width (the manifest's d_model), not the table's D'.
        self.scale = resolve_scale(scale, d_model)
        self.padding_idx = padding_idx
        self.word_embeddings = nn.Embedding(
            vocab_size, inner, padding_idx=padding_idx, _weight=words
        )
        self.embedding_hidden_mapping_in = nn.Linear(inner, d_model, bias=bias is not None)
        with torch.no_grad():
            self.embedding_hidden_mapping_in.weight.copy_(weight)
            if bias is not None:
                self.embedding_hidden_mapping_in.bias.copy_(bias.detach().to(torch.float32))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows: torch.Tensor = self.word_embeddings(input_ids)
        if self.scale != 1.0:
            rows = rows * self.scale
        out: torch.Tensor = self.embedding_hidden_mapping_in(rows)
        return out
