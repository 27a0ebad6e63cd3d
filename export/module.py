"""The torch module: ``[B,S]`` int64 ids to ``[B,S,D]`` float32, ``E[t] * scale``."""

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


class StoredAs(nn.Module):
    """The same computation with the table stored in another dtype (float16 or bfloat16
    halves it).

    The look-up happens in the stored dtype and the row is widened to float32 (exactly)
    before the scale, so the output stays float32 and the only error is the table's
    rounding. Rounded to the stored dtype, that output is what ``embedding(ids) * scale``
    computed in the stored dtype gives (torch multiplies a half or bfloat16 tensor by a
    Python float in float32, then rounds): the export checks both, bit for bit.
    """

    def __init__(self, module: TokenEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = module.scale
        self.weight = nn.Parameter(module.embedding.weight.detach().to(dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = nn.functional.embedding(input_ids, self.weight)
        return rows.to(torch.float32) * self.scale


def random_table(vocab_size: int, d_model: int, seed: int, padding_idx: int | None) -> torch.Tensor:
    """The seeded table ``nn.Embedding`` would initialise: N(0, 1), padding row zero."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab_size, d_model, generator=generator, dtype=torch.float32)
    if padding_idx is not None:
        table[padding_idx].zero_()
    return table
