"""Which ids an export's parity check looks up (torch-free: the built-in model uses it too)."""

from __future__ import annotations

import numpy as np

# Tables up to this size are checked on every row; larger ones on a random sample.
_FULL_PARITY_MAX_BYTES = 256 * 1024 * 1024
_SAMPLED_PARITY_IDS = 16384


def parity_ids(vocab_size: int, d_model: int, padding_idx: int | None, seed: int) -> np.ndarray:
    """Ids for the export check: every row for small tables, else a random sample; always
    0, V-1 and the padding id. Shaped ``[B,S]`` with B, S >= 2."""
    rng = np.random.default_rng(seed)
    if vocab_size * d_model * 4 <= _FULL_PARITY_MAX_BYTES:
        ids = rng.permutation(vocab_size)
    else:
        ids = rng.integers(0, vocab_size, size=_SAMPLED_PARITY_IDS)
    edges = [0, vocab_size - 1] + ([padding_idx] if padding_idx is not None else [])
    ids = np.concatenate([np.asarray(edges, dtype=np.int64), ids.astype(np.int64)])
    if ids.size % 2:
        ids = np.append(ids, vocab_size - 1)
    return ids.reshape(2, -1)
