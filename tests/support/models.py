"""Small models made by the tests themselves (nothing is ever downloaded)."""

from __future__ import annotations

import math
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
) -> Path:
    """Export a seeded random table with the real exporter (imports torch)."""
    from tokembed.export.module import TokenEmbedding, random_table
    from tokembed.export.onnx_export import ExportOptions, export_model

    table = random_table(vocab_size, d_model, seed, padding_idx)
    module = TokenEmbedding(vocab_size, d_model, padding_idx=padding_idx, weight=table)
    export_model(module, ExportOptions(out_dir=out_dir, name=name, weight_dtype=dtype, seed=seed))
    return out_dir


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
