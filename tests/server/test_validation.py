"""Validation before batching: every rule, and a message that names the bad value."""

from __future__ import annotations

import re
import tracemalloc
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from tokembed.server.core.errors import InvalidInput, TooLarge
from tokembed.server.core.types import FLAT, PADDED, EmbedInput
from tokembed.server.core.validation import Limits, validate

V, D = 100, 8
LIMITS = Limits(
    vocab_size=V,
    d_model=D,
    max_tokens_per_request=64,
    max_output_bytes_per_request=1 << 20,
)


def request(ids: Any, dtype: str = "int64", **fields: Any) -> EmbedInput:
    array = np.asarray(ids, dtype="<i8" if dtype == "int64" else "<i4")
    fields.setdefault("shape", array.shape)
    return EmbedInput(ids_dtype=dtype, data=array.tobytes(), **fields)


# --- ids against the vocabulary


@pytest.mark.parametrize(
    ("ids", "index", "value"),
    [
        ([[1, 2, 3], [4, -1, 6]], "1,1", -1),
        ([[1, 2, V]], "0,2", V),
        ([[V + 12345, 0]], "0,0", V + 12345),
        ([[0, -(2**40)]], "0,1", -(2**40)),
    ],
)
def test_ids_outside_the_vocabulary_name_the_index_and_the_value(
    ids: list[list[int]], index: str, value: int
) -> None:
    with pytest.raises(InvalidInput) as error:
        validate(request(ids), LIMITS)
    message = str(error.value)
    assert f"input_ids[{index}] = {value}" in message
    assert f"[0, {V})" in message


def test_out_of_vocabulary_message_counts_every_bad_id_and_names_the_first() -> None:
    with pytest.raises(InvalidInput, match=r"input_ids\[0,1\] = -1 .*\(3 ids in all\)"):
        validate(request([[0, -1, V, V + 1]]), LIMITS)


def test_bounds_of_the_vocabulary_are_accepted() -> None:
    job = validate(request([[0, V - 1]]), LIMITS)
    assert job.ids.values() == [0, V - 1]


def test_out_of_vocabulary_in_ragged_input_names_the_flat_index() -> None:
    with pytest.raises(InvalidInput, match=rf"input_ids\[3\] = {V} "):
        validate(request([1, 2, 3, V, 5], lengths=(2, 3)), LIMITS)


def test_int32_ids_are_checked_against_the_vocabulary_too() -> None:
    with pytest.raises(InvalidInput, match=r"input_ids\[0,0\] = -1 "):
        validate(request([[-1, 2]], dtype="int32"), LIMITS)


# --- dtypes


@pytest.mark.parametrize(
    "dtype", ["float32", "DTYPE_FLOAT32", "DTYPE_UNSPECIFIED", "42 (unknown DType value)"]
)
def test_unsupported_ids_dtype_is_named(dtype: str) -> None:
    with pytest.raises(InvalidInput) as error:
        validate(EmbedInput(ids_dtype=dtype, shape=(1, 1), data=bytes(8)), LIMITS)
    assert f"input_ids dtype {dtype} is not supported" in str(error.value)
    assert "int64 or int32" in str(error.value)


@pytest.mark.parametrize("dtype", ["DTYPE_INT64", "9 (unknown DType value)", "bfloat16"])
def test_unsupported_output_dtype_is_named(dtype: str) -> None:
    with pytest.raises(InvalidInput, match=re.escape(f"output_dtype {dtype} is not supported")):
        validate(request([[1]], output_dtype=dtype), LIMITS)


def test_unsupported_ragged_layout_is_named() -> None:
    with pytest.raises(InvalidInput, match=r"ragged_layout 7 \(unknown RaggedLayout value\)"):
        validate(request([1, 2], lengths=(2,), layout="7 (unknown RaggedLayout value)"), LIMITS)


def test_ragged_layout_is_ignored_for_rectangular_input() -> None:
    # The proto says the layout is only read for ragged input.
    job = validate(request([[1, 2]], layout="7 (unknown RaggedLayout value)"), LIMITS)
    assert job.layout == PADDED and job.lengths is None


def test_int32_ids_are_accepted_and_widened_to_int64_exactly() -> None:
    # Near the top of int32's range, where a wrong widening (or sign) would show.
    values = [[0, 1, 2**15, 2**31 - 1], [2**31 - 2, 8, 2**24 + 1, 10]]
    job = validate(request(values, dtype="int32"), replace(LIMITS, vocab_size=2**31))
    assert job.ids.array().dtype == np.int64
    assert job.ids.array().flags.c_contiguous
    assert job.ids.values() == [v for row in values for v in row]
    assert (job.batch, job.seq_len, job.tokens) == (2, 4, 8)


def test_int32_ids_need_four_bytes_each() -> None:
    # int64 bytes declared as int32: twice the data the shape allows.
    wrong = EmbedInput(ids_dtype="int32", shape=(1, 3), data=np.arange(3, dtype="<i8").tobytes())
    with pytest.raises(
        InvalidInput, match="data is 24 bytes, but shape \\[1, 3\\] of int32 needs 12"
    ):
        validate(wrong, LIMITS)


# --- shape and data


@pytest.mark.parametrize(("shape", "length"), [((2, 3), 40), ((2, 3), 56), ((1, 1), 0)])
def test_data_length_must_match_the_shape(shape: tuple[int, int], length: int) -> None:
    needed = shape[0] * shape[1] * 8
    with pytest.raises(InvalidInput) as error:
        validate(EmbedInput(ids_dtype="int64", shape=shape, data=bytes(length)), LIMITS)
    assert f"data is {length} bytes" in str(error.value)
    assert f"shape {list(shape)} of int64 needs {needed}" in str(error.value)


@pytest.mark.parametrize("shape", [(2**40, 2**40), (2**62, 2**62), (2**63 - 1, 3)])
def test_huge_declared_shape_with_tiny_data_is_rejected_without_overflow_or_allocation(
    shape: tuple[int, int],
) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput) as error:
            validate(EmbedInput(ids_dtype="int64", shape=shape, data=bytes(16)), LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    needed = shape[0] * shape[1] * 8  # exact, in Python ints: no wrap-around to 16
    assert f"data is 16 bytes, but shape {list(shape)} of int64 needs {needed}" in str(error.value)
    assert peak < 1 << 20, f"validation allocated {peak} bytes"


@pytest.mark.parametrize("shape", [(-1, 4), (4, -2), (-3,)])
def test_negative_dimensions_are_rejected(shape: tuple[int, ...]) -> None:
    with pytest.raises(InvalidInput, match=r"shape \[.*-\d.*\] has a negative dimension"):
        validate(EmbedInput(ids_dtype="int64", shape=shape, data=bytes(32)), LIMITS)


def test_negative_dimension_product_that_matches_the_data_is_still_rejected() -> None:
    # (-1) * (-2) = 2 tokens = 16 bytes: only the sign check stops it.
    with pytest.raises(InvalidInput, match="negative dimension"):
        validate(EmbedInput(ids_dtype="int64", shape=(-1, -2), data=bytes(16)), LIMITS)


@pytest.mark.parametrize("shape", [(4,), (1, 2, 2), ()])
def test_rank_other_than_two_without_lengths_is_rejected(shape: tuple[int, ...]) -> None:
    with pytest.raises(InvalidInput, match=r"must be \[B, S\] \(or \[N\] with lengths"):
        validate(EmbedInput(ids_dtype="int64", shape=shape, data=bytes(32)), LIMITS)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_empty_input_is_rejected(shape: tuple[int, int]) -> None:
    with pytest.raises(InvalidInput, match=rf"shape \[{shape[0]}, {shape[1]}\] is empty"):
        validate(EmbedInput(ids_dtype="int64", shape=shape, data=b""), LIMITS)


# --- ragged input


def test_ragged_lengths_must_sum_to_the_number_of_ids() -> None:
    with pytest.raises(InvalidInput, match=r"lengths sum to 4, but input_ids holds 5 ids"):
        validate(request([1, 2, 3, 4, 5], lengths=(1, 3)), LIMITS)


@pytest.mark.parametrize(("lengths", "index", "value"), [((2, 0, 3), 1, 0), ((-1, 6), 0, -1)])
def test_ragged_lengths_must_be_positive(lengths: tuple[int, ...], index: int, value: int) -> None:
    with pytest.raises(InvalidInput, match=rf"lengths\[{index}\] = {value}; every sequence"):
        validate(request([1, 2, 3, 4, 5], lengths=lengths), LIMITS)


def test_ragged_input_must_be_flat() -> None:
    with pytest.raises(InvalidInput, match=r"shape \[1, 3\] must be \[N\] \(flat\)"):
        validate(request([[1, 2, 3]], lengths=(3,)), LIMITS)


def test_ragged_geometry_and_layouts() -> None:
    padded = validate(request([1, 2, 3, 4, 5], lengths=(2, 3)), LIMITS)
    assert (padded.batch, padded.seq_len, padded.tokens) == (2, 3, 5)
    assert padded.lengths == (2, 3) and padded.ragged and padded.layout == PADDED
    assert padded.output_bytes == 2 * 3 * D * 4  # padded rows count
    flat = validate(request([1, 2, 3, 4, 5], lengths=(2, 3), layout=FLAT), LIMITS)
    assert flat.layout == FLAT and flat.output_bytes == 5 * D * 4
    assert flat.ids.values() == [1, 2, 3, 4, 5]


def test_layout_is_ignored_for_rectangular_input() -> None:
    job = validate(request([[1, 2]], layout=FLAT), LIMITS)
    assert job.layout == PADDED and job.lengths is None and not job.padded


# --- limits


def test_tokens_over_the_per_request_limit_are_too_large() -> None:
    ok = validate(request(np.zeros((8, 8))), LIMITS)
    assert ok.tokens == 64
    with pytest.raises(TooLarge, match="request has 65 tokens, over the limit of 64"):
        validate(request(np.zeros((5, 13))), LIMITS)


def test_output_bytes_over_the_limit_are_too_large_and_float16_halves_them() -> None:
    limits = Limits(
        vocab_size=V,
        d_model=D,
        max_tokens_per_request=1000,
        max_output_bytes_per_request=10 * D * 4,  # ten float32 rows
    )
    assert validate(request(np.zeros((2, 5))), limits).output_bytes == 10 * D * 4
    with pytest.raises(TooLarge) as error:
        validate(request(np.zeros((1, 11))), limits)
    assert f"response would be {11 * D * 4} bytes" in str(error.value)
    assert f"over the limit of {10 * D * 4}" in str(error.value)
    assert "float16" in str(error.value)
    half = validate(request(np.zeros((1, 20)), output_dtype="float16"), limits)
    assert half.output_bytes == 20 * D * 2 and half.output_dtype == np.float16
    with pytest.raises(TooLarge):
        validate(request(np.zeros((1, 21)), output_dtype="float16"), limits)


def test_padded_ragged_output_counts_the_padding_rows() -> None:
    limits = Limits(
        vocab_size=V,
        d_model=D,
        max_tokens_per_request=1000,
        max_output_bytes_per_request=12 * D * 4,
    )
    ids = list(range(11))
    # 11 tokens, but padded to [2, 10]: 20 rows.
    with pytest.raises(TooLarge, match="20 rows"):
        validate(request(ids, lengths=(1, 10)), limits)
    assert validate(request(ids, lengths=(1, 10), layout=FLAT), limits).output_bytes == 11 * D * 4


# --- model name


def test_valid_request_becomes_a_job() -> None:
    job = validate(request([[5, 6, 7], [8, 9, 10]], output_dtype="float32"), LIMITS)
    assert job.ids.values() == [5, 6, 7, 8, 9, 10]
    assert (job.batch, job.seq_len, job.lengths) == (2, 3, None)
    assert job.output_dtype == np.float32
    assert job.output_bytes == 6 * D * 4
