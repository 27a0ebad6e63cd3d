"""The torch module itself: E[t] * scale, its arguments, and the seeded random table."""

from __future__ import annotations

import math

import pytest
import torch

from tokembed.export.errors import ExportError
from tokembed.export.modules import TokenEmbedding, random_table, resolve_scale


@pytest.mark.parametrize(
    ("given", "d_model", "want"),
    [("sqrt", 512, math.sqrt(512)), (" SQRT ", 64, 8.0), ("none", 512, 1.0), ("0.5", 8, 0.5),
     (2.5, 8, 2.5), (3, 8, 3.0), ("1e-3", 8, 1e-3)],
)  # fmt: skip
def test_resolve_scale(given, d_model, want):
    assert resolve_scale(given, d_model) == want


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "-inf", "half", "", 0.0, -2.0])
def test_resolve_scale_refuses(bad):
    with pytest.raises(ExportError, match="--scale must be"):
        resolve_scale(bad, 8)


def test_forward_is_lookup_times_scale():
    table = torch.randn(10, 4)
    module = TokenEmbedding(10, 4, scale=0.75, weight=table.clone())
    ids = torch.tensor([[1, 9, 1], [0, 0, 5]])
    out = module(ids)
    assert out.shape == (2, 3, 4) and out.dtype == torch.float32
    assert torch.equal(out, table[ids] * 0.75)


def test_default_scale_is_sqrt_d():
    assert TokenEmbedding(10, 16).scale == 4.0


def test_padding_row_starts_at_zero_without_weights():
    module = TokenEmbedding(10, 4, padding_idx=2)
    assert not module.embedding.weight[2].any()
    assert module.embedding.weight[3].any()


def test_given_weight_is_kept_as_is():
    table = torch.randn(10, 4, dtype=torch.float64)
    module = TokenEmbedding(10, 4, padding_idx=2, weight=table)
    assert module.embedding.weight.dtype == torch.float32
    assert torch.equal(module.embedding.weight, table.float())  # row 2 not zeroed


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"vocab_size": 0, "d_model": 4}, "vocab size must be positive, got 0"),
        ({"vocab_size": 4, "d_model": -1}, "d_model must be positive, got -1"),
        ({"vocab_size": 4, "d_model": 2, "padding_idx": 4}, r"padding id 4 is outside \[0, 4\)"),
        ({"vocab_size": 4, "d_model": 2, "padding_idx": -1}, r"padding id -1 is outside"),
        ({"vocab_size": 4, "d_model": 2, "weight": torch.zeros(4, 3)}, r"weight is \[4, 3\]"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ExportError, match=match):
        TokenEmbedding(**kwargs)


def test_random_table_is_seeded_randn():
    want = torch.randn(50, 6, generator=torch.Generator().manual_seed(9))
    assert torch.equal(random_table(50, 6, 9, None), want)
    padded = random_table(50, 6, 9, 7)
    assert not padded[7].any()
    assert torch.equal(padded[:7], want[:7]) and torch.equal(padded[8:], want[8:])
