"""Small models made by the tests themselves (nothing is ever downloaded), and their answers
computed independently of the exporter (the session fixtures ``small_rows``, ``decoder_rows``
and ``default_rows`` of support.fixtures hold them)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def export_model_dir(
    out_dir: Path,
    *,
    vocab_size: int,
    d_model: int,
    seed: int = 0,
    padding_idx: int | None = None,
    dtype: str = "float32",
    name: str = "test-model",
    version: str = "1",
) -> Path:
    """Export a seeded random table with the real exporter (imports torch)."""
    from tokembed.export.modules import TokenEmbedding, random_table
    from tokembed.export.pipeline import ExportOptions, export_model

    table = random_table(vocab_size, d_model, seed, padding_idx)
    module = TokenEmbedding(vocab_size, d_model, padding_idx=padding_idx, weight=table)
    export_model(
        module,
        ExportOptions(out_dir=out_dir, name=name, version=version, weight_dtype=dtype, seed=seed),
    )
    return out_dir


def build_default_model_dir(out_dir: Path) -> Path:
    """The built-in default model, built as ``tokembed serve`` builds it (no torch)."""
    from tokembed.export.builtin import build_builtin_model

    assert build_builtin_model(out_dir)
    return out_dir


def default_model_rows() -> np.ndarray:
    """The built-in default model's answer for every id, computed here from its definition,
    independently of the builder: E from PCG64(0)'s raw 64-bit draws, each value from the
    top 24 bits k of one draw as (2k + 1 - 2**24) / 2**24 * sqrt(3), row after row; the
    answer is E[id] * sqrt(512) in float32, read-only. Tests take it from the session
    fixture ``default_rows``, which computes it once."""
    vocab_size, d_model = 32000, 512
    k = np.random.PCG64(0).random_raw(vocab_size * d_model) >> np.uint64(40)
    centred = (k.astype(np.float64) * 2 + 1 - 2**24) / 2**24  # exact: 25-bit integers / 2**24
    table = (centred * math.sqrt(3)).astype(np.float32).reshape(vocab_size, d_model)
    rows = table * np.float32(math.sqrt(d_model))
    rows.setflags(write=False)
    return rows


def reference_rows(
    vocab_size: int, d_model: int, seed: int, padding_idx: int | None = None
) -> np.ndarray:
    """E * sqrt(D), computed independently of the exporter's graph: the expected answers."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab_size, d_model, generator=generator, dtype=torch.float32)
    if padding_idx is not None:
        table[padding_idx].zero_()
    return (table * math.sqrt(d_model)).numpy()


def padded(rows: np.ndarray, seqs: Sequence[Sequence[int]], pad_row: np.ndarray) -> np.ndarray:
    """The expected ``[B, S_max, D]`` answer to ragged ``seqs``: each sequence's rows, then
    ``pad_row`` (the proto: the padding id's row, or zeros for a model without one)."""
    longest = max(len(s) for s in seqs)
    out = np.empty((len(seqs), longest, rows.shape[1]), rows.dtype)
    for b, seq in enumerate(seqs):
        out[b, : len(seq)] = rows[list(seq)]
        out[b, len(seq) :] = pad_row
    return out
