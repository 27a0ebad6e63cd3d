"""The export's parity check: which ids it looks up, its tolerance, and the comparison a slice
of ids at a time (torch-free: the built-in model uses it too)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tokembed.export.errors import ParityError
from tokembed.export.manifest import Parity

# Tables up to this size are checked on every row; larger ones on a random sample.
# What a terminal shows while the check runs (``hashing.phase``).
PARITY_PHASE = "checking the graph in onnxruntime against torch"
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


# Relative rounding of a float32 value stored in a narrower dtype (half its ulp), and the
# absolute error where the narrower dtype runs out of exponent (its subnormals): float16's
# smallest subnormal step is 2**-24; bfloat16 has float32's exponent range, so only its
# own subnormals, spaced 2**-133, round.
_RELATIVE = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}
_FLOOR = {"float32": 0.0, "float16": 2.0**-24, "bfloat16": 2.0**-133}


def storage_tolerance(weight_dtype: str, largest: float, scale: float) -> float:
    """The largest difference a table stored as ``weight_dtype`` may show against its
    float32 values times ``scale``, for a table whose largest magnitude is ``largest``.

    float32: 0, exactly (a row copy and one float32 multiply on both sides). A narrower
    dtype rounds each weight to nearest (``_RELATIVE`` of its magnitude, ``_FLOOR`` in
    its subnormal range); the float32 multiply then adds at most one ulp on each side
    (``2**-22`` of the magnitude, together).
    """
    if weight_dtype not in _RELATIVE:
        raise ValueError(f"no tolerance for {weight_dtype} weights")
    if weight_dtype == "float32":
        return 0.0
    return scale * (largest * (_RELATIVE[weight_dtype] + 2.0**-22) + _FLOOR[weight_dtype])


def check_in_slices(
    run: Callable[[np.ndarray], np.ndarray],
    reference: Callable[[np.ndarray], np.ndarray],
    ids: np.ndarray,
    *,
    tolerance: float,
    weight_dtype: str,
    slice_bytes: int,
    d_model: int,
    seed: int = 0,
    answers: Callable[[np.ndarray, np.ndarray], None] | None = None,
) -> Parity:
    """Compare ``run`` (the exported graph on ``[2, n]`` ids) with ``reference`` (the
    expected float32 ``[n, D]`` rows of flat ids) over ``ids``, a slice at a time: the
    answers of one slice (``slice_bytes`` of float32 rows on each side) are all that is
    held, however many ids are checked. ``ParityError`` past ``tolerance`` (or on NaN).

    The slices take the ids in ascending order, so that the rows one slice reads lie in
    one region of the table (a reference that reads a memory-mapped file then maps a
    region per slice, not the whole file: see ``weights.CheckpointMatrix.release``); each
    slice is shuffled (seeded) before it is run, so the graph still sees ids out of order.
    ``answers``, when given, is called with each slice's flat ids and the graph's answer
    for them, after ``reference``, for checks of its own (raising ``ParityError``).
    """
    flat = np.sort(ids.reshape(-1))
    if flat.size % 2:
        raise ValueError("this is a bug: parity ids come in [2, n] batches")
    # Even, so that every slice is a [2, n] batch (B and S both dynamic in the graph).
    step = max(2, slice_bytes // (4 * d_model) // 2 * 2)
    rng = np.random.default_rng(seed)
    error = 0.0
    for start in range(0, flat.size, step):
        piece = rng.permutation(flat[start : start + step])
        got = run(piece.reshape(2, -1))
        if got.dtype != np.float32 or got.shape != (2, piece.size // 2, d_model):
            raise ParityError(
                f"ONNX output is {got.dtype}{list(got.shape)}, expected float32 "
                f"{[2, piece.size // 2, d_model]}"
            )
        want = reference(piece)
        difference = np.abs(got.reshape(-1, d_model).astype(np.float64) - want.astype(np.float64))
        # max() propagates NaN, and the test below is written so that NaN fails.
        piece_error = float(difference.max())
        if not piece_error <= tolerance:
            error = piece_error
            break
        error = max(error, piece_error)
        if answers is not None:
            answers(piece, got.reshape(-1, d_model))
    if not error <= tolerance:
        raise ParityError(
            f"ONNX output differs from torch by {error:g} (tolerance {tolerance:g} for "
            f"{weight_dtype} weights) over {flat.size} ids"
        )
    return Parity(max_abs_error=error, tolerance=tolerance, ids_checked=int(flat.size))
