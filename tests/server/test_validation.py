"""Validation before batching (``operations.embed.validate``): every rule, and a message
that names the bad value. Requests are validated against a served model, the small one
(V=1000, D=64, a ``token`` model) as the server loads it, under the limits each test
sets (``served``)."""

from __future__ import annotations

import re
import tracemalloc
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from tokembed.server.core.dtypes import FLOAT16, FLOAT32, INT64
from tokembed.server.core.errors import InvalidInput, TooLarge
from tokembed.server.core.operations.embed import (
    EMBED,
    FLAT,
    PADDED,
    SEQUENCE_FIRST,
    EmbedInput,
    IdsInput,
    validate,
)
from tokembed.server.core.served import BatchLimits, Limits, ServedModel
from tokembed.server.core.types import Timings
from tokembed.server.models.loading import LoadedModel

from support.fixtures import SMALL_D, SMALL_V

V, D = SMALL_V, SMALL_D


def served(
    loaded: LoadedModel,
    *,
    max_tokens: int = 64,
    max_output_bytes: int = 1 << 20,
    vocab_size: int | None = None,
) -> ServedModel:
    """The small model served under these limits (and, to probe the bound alone, a
    vocabulary of ``vocab_size`` claimed by its manifest)."""
    model = loaded.model
    if vocab_size is not None:
        model = replace(model, manifest=replace(model.manifest, vocab_size=vocab_size))
    return ServedModel(
        model,
        loaded.backend,
        Limits(max_tokens, max_output_bytes),
        BatchLimits(16384, 0.002, 1, 1 << 20),
    )


@pytest.fixture(scope="module")
def model(small_loaded: LoadedModel) -> ServedModel:
    """64 tokens and 1 MiB of answer a request."""
    return served(small_loaded)


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
    ids: list[list[int]], index: str, value: int, model: ServedModel
) -> None:
    with pytest.raises(InvalidInput) as error:
        validate(request(ids), model)
    message = str(error.value)
    assert f"input_ids[{index}] = {value}" in message
    assert f"[0, {V})" in message


def test_out_of_vocabulary_message_counts_every_bad_id_and_names_the_first(
    model: ServedModel,
) -> None:
    with pytest.raises(InvalidInput, match=r"input_ids\[0,1\] = -1 .*\(3 ids in all\)"):
        validate(request([[0, -1, V, V + 1]]), model)


def test_bounds_of_the_vocabulary_are_accepted(model: ServedModel) -> None:
    job = validate(request([[0, V - 1]]), model)
    assert job.look_up.ids.values() == [0, V - 1]


def test_out_of_vocabulary_in_ragged_input_names_the_flat_index(model: ServedModel) -> None:
    with pytest.raises(InvalidInput, match=rf"input_ids\[3\] = {V} "):
        validate(request([1, 2, 3, V, 5], lengths=(2, 3)), model)


def test_int32_ids_are_checked_against_the_vocabulary_too(model: ServedModel) -> None:
    with pytest.raises(InvalidInput, match=r"input_ids\[0,0\] = -1 "):
        validate(request([[-1, 2]], dtype="int32"), model)


# --- dtypes


@pytest.mark.parametrize(
    "dtype", ["float32", "DTYPE_FLOAT32", "DTYPE_UNSPECIFIED", "42 (unknown DType value)"]
)
def test_unsupported_ids_dtype_is_named(dtype: str, model: ServedModel) -> None:
    with pytest.raises(InvalidInput) as error:
        validate(EmbedInput(ids_dtype=dtype, shape=(1, 1), data=bytes(8)), model)
    assert f"input_ids dtype {dtype} is not supported" in str(error.value)
    assert "int64 or int32" in str(error.value)


@pytest.mark.parametrize("dtype", ["DTYPE_INT64", "9 (unknown DType value)", "float64"])
def test_unsupported_output_dtype_is_named(dtype: str, model: ServedModel) -> None:
    with pytest.raises(InvalidInput, match=re.escape(f"output_dtype {dtype} is not supported")):
        validate(request([[1]], output_dtype=dtype), model)


def test_unsupported_ragged_layout_is_named(model: ServedModel) -> None:
    with pytest.raises(InvalidInput, match=r"ragged_layout 7 \(unknown RaggedLayout value\)"):
        validate(request([1, 2], lengths=(2,), layout="7 (unknown RaggedLayout value)"), model)


def test_ragged_layout_is_ignored_for_rectangular_input(model: ServedModel) -> None:
    # The proto says the layout is only read for ragged input.
    job = validate(request([[1, 2]], layout="7 (unknown RaggedLayout value)"), model)
    assert job.layout == PADDED and job.lengths is None


def test_int32_ids_are_accepted_and_widened_to_int64_exactly(small_loaded: LoadedModel) -> None:
    # Near the top of int32's range, where a wrong widening (or sign) would show: against a
    # vocabulary that large, claimed by the manifest (the bound validation reads).
    values = [[0, 1, 2**15, 2**31 - 1], [2**31 - 2, 8, 2**24 + 1, 10]]
    job = validate(request(values, dtype="int32"), served(small_loaded, vocab_size=2**31))
    ids = job.look_up.ids
    assert ids.array().dtype == np.int64
    assert ids.array().flags.c_contiguous
    assert ids.values() == [v for row in values for v in row]
    assert (job.batch, job.seq_len, job.tokens) == (2, 4, 8)


def test_int32_ids_need_four_bytes_each(model: ServedModel) -> None:
    # int64 bytes declared as int32: twice the data the shape allows.
    wrong = EmbedInput(ids_dtype="int32", shape=(1, 3), data=np.arange(3, dtype="<i8").tobytes())
    with pytest.raises(
        InvalidInput, match="data is 24 bytes, but shape \\[1, 3\\] of int32 needs 12"
    ):
        validate(wrong, model)


# --- shape and data


@pytest.mark.parametrize(("shape", "length"), [((2, 3), 40), ((2, 3), 56), ((1, 1), 0)])
def test_data_length_must_match_the_shape(
    shape: tuple[int, int], length: int, model: ServedModel
) -> None:
    needed = shape[0] * shape[1] * 8
    with pytest.raises(InvalidInput) as error:
        validate(EmbedInput(ids_dtype="int64", shape=shape, data=bytes(length)), model)
    assert f"data is {length} bytes" in str(error.value)
    assert f"shape {list(shape)} of int64 needs {needed}" in str(error.value)


@pytest.mark.parametrize("shape", [(2**40, 2**40), (2**62, 2**62), (2**63 - 1, 3)])
def test_huge_declared_shape_with_tiny_data_is_rejected_without_overflow_or_allocation(
    shape: tuple[int, int],
    model: ServedModel,
) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput) as error:
            validate(EmbedInput(ids_dtype="int64", shape=shape, data=bytes(16)), model)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    needed = shape[0] * shape[1] * 8  # exact, in Python ints: no wrap-around to 16
    assert f"data is 16 bytes, but shape {list(shape)} of int64 needs {needed}" in str(error.value)
    assert peak < 1 << 20, f"validation allocated {peak} bytes"


@pytest.mark.parametrize("shape", [(-1, 4), (4, -2), (-3,)])
def test_negative_dimensions_are_rejected(shape: tuple[int, ...], model: ServedModel) -> None:
    with pytest.raises(InvalidInput, match=r"shape \[.*-\d.*\] has a negative dimension"):
        validate(EmbedInput(ids_dtype="int64", shape=shape, data=bytes(32)), model)


def test_negative_dimension_product_that_matches_the_data_is_still_rejected(
    model: ServedModel,
) -> None:
    # (-1) * (-2) = 2 tokens = 16 bytes: only the sign check stops it.
    with pytest.raises(InvalidInput, match="negative dimension"):
        validate(EmbedInput(ids_dtype="int64", shape=(-1, -2), data=bytes(16)), model)


@pytest.mark.parametrize("shape", [(4,), (1, 2, 2), ()])
def test_rank_other_than_two_without_lengths_is_rejected(
    shape: tuple[int, ...], model: ServedModel
) -> None:
    with pytest.raises(InvalidInput, match=r"must be \[B, S\] \(or \[N\] with lengths"):
        validate(EmbedInput(ids_dtype="int64", shape=shape, data=bytes(32)), model)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_empty_input_is_rejected(shape: tuple[int, int], model: ServedModel) -> None:
    with pytest.raises(InvalidInput, match=rf"shape \[{shape[0]}, {shape[1]}\] is empty"):
        validate(EmbedInput(ids_dtype="int64", shape=shape, data=b""), model)


# --- ragged input


def test_ragged_lengths_must_sum_to_the_number_of_ids(model: ServedModel) -> None:
    with pytest.raises(InvalidInput, match=r"lengths sum to 4, but input_ids holds 5 ids"):
        validate(request([1, 2, 3, 4, 5], lengths=(1, 3)), model)


@pytest.mark.parametrize(("lengths", "index", "value"), [((2, 0, 3), 1, 0), ((-1, 6), 0, -1)])
def test_ragged_lengths_must_be_positive(
    lengths: tuple[int, ...], index: int, value: int, model: ServedModel
) -> None:
    with pytest.raises(InvalidInput, match=rf"lengths\[{index}\] = {value}; every sequence"):
        validate(request([1, 2, 3, 4, 5], lengths=lengths), model)


def test_ragged_input_must_be_flat(model: ServedModel) -> None:
    with pytest.raises(InvalidInput, match=r"shape \[1, 3\] must be \[N\] \(flat\)"):
        validate(request([[1, 2, 3]], lengths=(3,)), model)


def test_ragged_geometry_and_layouts(model: ServedModel) -> None:
    padded = validate(request([1, 2, 3, 4, 5], lengths=(2, 3)), model)
    assert (padded.batch, padded.seq_len, padded.tokens) == (2, 3, 5)
    assert padded.lengths == (2, 3) and padded.padded and padded.layout == PADDED
    assert padded.output_bytes == 2 * 3 * D * 4  # padded rows count
    flat = validate(request([1, 2, 3, 4, 5], lengths=(2, 3), layout=FLAT), model)
    assert flat.layout == FLAT and not flat.padded and flat.output_bytes == 5 * D * 4
    assert flat.look_up.ids.values() == [1, 2, 3, 4, 5]
    assert flat.answer_shape(D) == (5, D) and padded.answer_shape(D) == (2, 3, D)


def test_layout_is_ignored_for_rectangular_input(model: ServedModel) -> None:
    job = validate(request([[1, 2]], layout=FLAT), model)
    assert job.layout == PADDED and job.lengths is None and not job.padded


# --- limits


def test_tokens_over_the_per_request_limit_are_too_large(model: ServedModel) -> None:
    ok = validate(request(np.zeros((8, 8))), model)
    assert ok.tokens == 64
    with pytest.raises(TooLarge, match="request has 65 tokens, over the limit of 64"):
        validate(request(np.zeros((5, 13))), model)


def test_output_bytes_over_the_limit_are_too_large_and_float16_halves_them(
    small_loaded: LoadedModel,
) -> None:
    limits = served(small_loaded, max_tokens=1000, max_output_bytes=10 * D * 4)  # ten rows
    assert validate(request(np.zeros((2, 5))), limits).output_bytes == 10 * D * 4
    with pytest.raises(TooLarge) as error:
        validate(request(np.zeros((1, 11))), limits)
    assert f"response would be {11 * D * 4} bytes" in str(error.value)
    assert f"over the limit of {10 * D * 4}" in str(error.value)
    assert "float16" in str(error.value)
    half = validate(request(np.zeros((1, 20)), output_dtype="float16"), limits)
    assert half.output_bytes == 20 * D * 2 and half.output_dtype is FLOAT16
    with pytest.raises(TooLarge):
        validate(request(np.zeros((1, 21)), output_dtype="float16"), limits)


def test_padded_ragged_output_counts_the_padding_rows(small_loaded: LoadedModel) -> None:
    limits = served(small_loaded, max_tokens=1000, max_output_bytes=12 * D * 4)
    ids = list(range(11))
    # 11 tokens, but padded to [2, 10]: 20 rows.
    with pytest.raises(TooLarge, match="20 rows"):
        validate(request(ids, lengths=(1, 10)), limits)
    assert validate(request(ids, lengths=(1, 10), layout=FLAT), limits).output_bytes == 11 * D * 4


# --- the model kind's inputs


def test_ids_a_token_model_does_not_take_are_refused_naming_them(model: ServedModel) -> None:
    extra = IdsInput("int64", (1, 2), np.zeros(2, "<i8").tobytes())
    sent = request([[1, 2]], more_ids={"token_type_ids": extra})
    with pytest.raises(InvalidInput) as error:
        validate(sent, model)
    assert str(error.value) == (
        "unexpected input 'token_type_ids': model 'small' (token kind) takes input_ids "
        "(and lengths, for ragged ids)"
    )


# --- the job


def test_valid_request_becomes_a_job(model: ServedModel) -> None:
    job = validate(request([[5, 6, 7], [8, 9, 10]], output_dtype="float32"), model)
    assert job.look_up.ids.values() == [5, 6, 7, 8, 9, 10]
    assert job.look_up.ids.array().dtype == INT64.numpy
    assert job.look_up.more == {}  # a token model has no other inputs
    assert (job.batch, job.seq_len, job.lengths) == (2, 3, None)
    assert job.output_dtype is FLOAT32 and job.look_up.dtype is FLOAT32
    assert job.output_bytes == 6 * D * 4
    assert job.answer_shape(D) == (2, 3, D)
    # The operation validates the same way: it is the one the data plane calls.
    assert EMBED.validate(request([[5, 6, 7], [8, 9, 10]]), model).look_up.ids.values() == (
        job.look_up.ids.values()
    )


# --- sequence-first


def test_sequence_first_ids_are_s_by_b(model: ServedModel) -> None:
    job = validate(request([[1, 2, 3], [4, 5, 6]], order=SEQUENCE_FIRST), model)  # [S=2, B=3]
    assert (job.batch, job.seq_len, job.tokens) == (3, 2, 6)
    assert job.answer_shape(D) == (2, 3, D)
    assert job.look_up.ids.values() == [1, 2, 3, 4, 5, 6]  # looked up in the ids' order


def test_sequence_first_ragged_is_padded_s_max_by_b(model: ServedModel) -> None:
    job = validate(request([1, 2, 3, 4], lengths=(3, 1), order=SEQUENCE_FIRST), model)
    assert job.answer_shape(D) == (3, 2, D)
    assert job.output_bytes == 3 * 2 * D * 4  # padding counted, as batch-first


def test_sequence_first_flat_is_refused(model: ServedModel) -> None:
    with pytest.raises(
        InvalidInput, match=re.escape("FLAT answers [N, D], which has no batch axis")
    ):
        validate(request([1, 2, 3], lengths=(2, 1), layout=FLAT, order=SEQUENCE_FIRST), model)


def test_sequence_first_shape_and_bound_messages_name_s_by_b(model: ServedModel) -> None:
    with pytest.raises(InvalidInput, match=re.escape("must be [S, B] (sequence-first)")):
        validate(request([1, 2], order=SEQUENCE_FIRST), model)
    # The index is in the request's own [S, B] shape.
    with pytest.raises(InvalidInput, match=re.escape(f"input_ids[2,0] = {V} ")):
        validate(request([[1, 2], [3, 4], [V, 5]], order=SEQUENCE_FIRST), model)


def test_sequence_first_answers_are_the_rows_reordered_position_by_position(
    model: ServedModel,
) -> None:
    """A ragged sequence-first answer is the batch-first one transposed: the rows at
    position 0 of each sequence, then at 1, padding where a sequence has ended."""
    ids = [7, 8, 9, 20, 30, 31]  # sequences [7, 8, 9], [20], [30, 31]
    for order, shape in ((SEQUENCE_FIRST, (3, 3, D)), ("batch_first", (3, 3, D))):
        job = validate(request(ids, lengths=(3, 1, 2), order=order), model)
        (rows,) = EMBED.compute(model.backend, [job])
        answer = EMBED.answer(job, rows, Timings(0.0, 0.0, 1, 6), model)
        assert answer.shape == shape
        array = np.frombuffer(b"".join(answer.pieces), dtype=np.float32).reshape(shape)
        if order == SEQUENCE_FIRST:
            sequence_first = array
        else:
            batch_first = array
    np.testing.assert_array_equal(sequence_first, batch_first.transpose(1, 0, 2))
    pad = model.backend.pad_row(FLOAT32)
    assert sequence_first[1, 1].tobytes() == pad and sequence_first[2, 2].tobytes() == pad


def test_an_unknown_layout_is_named(model: ServedModel) -> None:
    with pytest.raises(InvalidInput, match=re.escape("layout sideways is not supported")):
        validate(request([[1]], order="sideways"), model)
