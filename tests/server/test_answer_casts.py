"""The server's casts of float32 rows into float16 and bfloat16 answers
(``backends.sessions.output_casts``), bit for bit against torch.

torch's answer in a narrow dtype is either a cast of the float32 answer (``.to(dtype)``)
or, for a table stored in that dtype, ``embedding(ids) * scale`` computed in it: torch
multiplies a float16 or bfloat16 tensor by a Python float in float32 (its "opmath") and
rounds the product to nearest even. Both must be the server's cast of the float32 product
(the graph's ``float32(row) * float32(scale)``), which is checked here over every
bfloat16 and every float16 value times several scales, and over random float32 bit
patterns with the ties, subnormals, overflows and infinities planted among them.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from tokembed.server.backends.sessions import SessionOptions, output_casts
from tokembed.server.core.dtypes import BFLOAT16, FLOAT16, DType

CASTS = output_casts(SessionOptions())
# sqrt(D) of common widths (none a power of two but sqrt(4096)), a scale below 1, and 1.
SCALES = [math.sqrt(d) for d in (48, 512, 768, 1024, 4096, 8192)] + [0.0371, 1.0]
NARROW = {BFLOAT16: torch.bfloat16, FLOAT16: torch.float16}


def every_value(dtype: DType) -> torch.Tensor:
    """Every bit pattern of a 16-bit dtype but its NaNs."""
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = patterns.view(NARROW[dtype])
    return values[~torch.isnan(values)]


def server_bits(dtype: DType, float32: np.ndarray) -> np.ndarray:
    answer = CASTS[dtype](float32)
    assert answer.dtype == dtype.numpy
    return answer.view(np.uint16)


def torch_bits(values: torch.Tensor) -> np.ndarray:
    return values.view(torch.int16).numpy().view(np.uint16)


def same(ours: np.ndarray, theirs: np.ndarray) -> None:
    differ = np.flatnonzero(ours != theirs)
    assert differ.size == 0, (
        f"{differ.size} of {ours.size} differ; first: ours {ours[differ[0]]:#06x}, "
        f"torch's {theirs[differ[0]]:#06x}"
    )


@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: d.name)
@pytest.mark.parametrize("scale", SCALES)
def test_a_narrow_table_times_the_scale_in_its_dtype_is_the_cast_of_the_float32_product(
    dtype: DType, scale: float
) -> None:
    """torch's ``row * scale`` in bfloat16 (float16) for every finite and infinite
    value of the dtype: the server's cast of float32(row) * float32(scale). The products
    past the dtype's largest value (infinity in both) and the subnormal ones included."""
    rows = every_value(dtype)
    # The graph's Mul; bfloat16's largest values times a scale > 1 overflow float32 too.
    with np.errstate(over="ignore"):
        product = rows.to(torch.float32).numpy() * np.float32(scale)
    same(server_bits(dtype, product), torch_bits(rows * scale))


@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: d.name)
def test_casts_of_float32_values_are_torchs(dtype: DType) -> None:
    """``.to(dtype)`` of float32 answers: random bit patterns (every exponent, so
    subnormals and values past the narrow dtype's range), exact ties (half way between
    two neighbours: round to the even one), one unit either side of a tie, and the
    infinities, zeros and float32's extremes."""
    rng = np.random.default_rng(25)
    patterns = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    # The bits a narrow value drops: 16 for bfloat16; float16 keeps 10 of float32's 23
    # fraction bits, so 13 (its subnormals drop more: the random patterns cover them).
    dropped = 16 if dtype == BFLOAT16 else 13
    half = np.uint32(1 << (dropped - 1))
    ties = (patterns & ~np.uint32((1 << dropped) - 1)) | half
    extremes = np.array(
        [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 1, 0x80000001,
         0x00800000, 0x007FFFFF, 0x477FEFFF, 0x477FF000, 0x7F7F8000, 0x7F7F7FFF],
        dtype=np.uint32,
    )  # fmt: skip
    bits = np.concatenate([patterns, ties, ties - 1, ties + 1, extremes])
    values = bits.view(np.float32)
    values = values[~np.isnan(values)]
    with np.errstate(over="ignore"):  # numpy's float16 reference warns on overflow
        theirs = torch_bits(torch.from_numpy(values).to(NARROW[dtype]))
    same(server_bits(dtype, values), theirs)


@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: d.name)
def test_nan_stays_nan(dtype: DType) -> None:
    """A NaN never reaches a cast (the exporter refuses a table whose answers are not
    finite), but were one to, it would stay a NaN (torch's own bits differ by path:
    0x7FC0 from a bfloat16 multiply, 0xFFFF from a vectorised float32 cast)."""
    nans = np.array([np.nan, -np.nan], dtype=np.float32)
    with np.errstate(invalid="ignore"):
        answer = CASTS[dtype](nans)
    assert np.isnan(answer.astype(np.float32)).all()


def test_the_bfloat16_answer_is_ml_dtypes_bfloat16() -> None:
    answer = CASTS[BFLOAT16](np.array([[1.5, -2.0]], dtype=np.float32))
    assert answer.dtype == np.dtype(ml_dtypes.bfloat16) and answer.flags.c_contiguous
