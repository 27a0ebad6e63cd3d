"""User input -> EmbedRequest: every accepted form, and what is refused before sending."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokembed.client import InvalidInputError
from tokembed.client.codec import encode_ids, encode_request, output_dtype_code
from tokembed.v1 import embedding_pb2 as pb

_WIRE_NP = {pb.DTYPE_INT64: "<i8", pb.DTYPE_INT32: "<i4"}


def wire_ids(request: pb.EmbedRequest) -> np.ndarray:
    """What the server will read: the ids as sent, in their declared shape."""
    t = request.input_ids
    return np.frombuffer(t.data, _WIRE_NP[t.dtype]).reshape(tuple(t.shape))


def request_for(ids: Any, **kwargs: Any) -> pb.EmbedRequest:
    # What goes on the wire, parsed by protobuf as the server parses it.
    return pb.EmbedRequest.FromString(encode_request(encode_ids(ids), **kwargs))


def test_int64_array_travels_as_is() -> None:
    ids = np.array([[5, 6, 7, 8], [9, 10, 11, 12]], dtype=np.int64)
    req = request_for(ids)
    assert req.input_ids.dtype == pb.DTYPE_INT64
    assert list(req.input_ids.shape) == [2, 4]
    assert len(req.input_ids.data) == 8 * 8
    assert np.array_equal(wire_ids(req), ids)
    assert list(req.lengths) == []
    assert req.output_dtype == pb.DTYPE_FLOAT32


def test_int32_stays_int32_on_the_wire() -> None:
    ids = np.array([[1, 2, 3]], dtype=np.int32)
    req = request_for(ids)
    assert req.input_ids.dtype == pb.DTYPE_INT32
    assert len(req.input_ids.data) == 3 * 4
    assert np.array_equal(wire_ids(req), ids)


@pytest.mark.parametrize(
    ("dtype", "wire"),
    [
        (np.int8, pb.DTYPE_INT32),
        (np.int16, pb.DTYPE_INT32),
        (np.uint8, pb.DTYPE_INT32),
        (np.uint16, pb.DTYPE_INT32),
        (np.uint32, pb.DTYPE_INT64),
        (np.uint64, pb.DTYPE_INT64),
        (">i8", pb.DTYPE_INT64),  # big-endian in memory, little-endian on the wire
        (">i4", pb.DTYPE_INT32),
    ],
)
def test_other_integer_dtypes_convert_losslessly(dtype: Any, wire: int) -> None:
    ids = np.array([[0, 1, 100, 127]], dtype=dtype)
    req = request_for(ids)
    assert req.input_ids.dtype == wire
    assert wire_ids(req).tolist() == [[0, 1, 100, 127]]


def test_uint32_max_survives() -> None:
    ids = np.array([np.iinfo(np.uint32).max], dtype=np.uint32)
    assert wire_ids(request_for(ids)).tolist() == [[np.iinfo(np.uint32).max]]


def test_uint64_beyond_int64_is_refused() -> None:
    ids = np.array([1, 2**63], dtype=np.uint64)
    with pytest.raises(InvalidInputError, match="does not fit in int64"):
        encode_ids(ids)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (np.array([[1.0, 2.0]]), r"integers, got dtype float64 \(if the values are whole"),
        (np.array([[1.5]], dtype=np.float32), "float32"),
        (np.array([True, False]), "bool"),
        ([[1.0, 2.0]], "float64"),
        ("5 6 7", "got str"),
        (b"\x05\x06", "got bytes"),
        (np.array(["a", "b"]), "integers"),
        (object(), "got object"),
        (5, "got int"),
        (np.int64(5), "single number"),
        (np.zeros((1, 2, 3), dtype=np.int64), r"shape \(1, 2, 3\)"),
        (np.zeros((0, 4), dtype=np.int64), "empty"),
        (np.zeros((3, 0), dtype=np.int64), "empty"),
        ([], "empty"),
        ([[1, 2], []], "sequence 1 is empty"),
        ([[1, 2], 3], "element 1"),
        ([[1, 2], [[3]]], "sequence 1 has shape"),
        ([2**70], "element 0 = 1180591620717411303424 does not fit in int64"),
        # Sequences of bools beside sequences of ints (numpy reads them together as ints).
        ([[True, False], [1, 2]], "sequence 0 must be integers, got dtype bool"),
        ([[1, 2], [True, False]], "sequence 1 must be integers, got dtype bool"),
        ([np.array([True, False]), [1, 2]], "sequence 0 must be integers, got dtype bool"),
        ([[1.5, 2.0], [1, 2]], "sequence 0 must be integers, got dtype float64"),
    ],
)
def test_refused_before_sending(ids: Any, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match) as info:
        encode_ids(ids)
    # The code the server would answer with, so both are handled alike.
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.reason == "invalid_input"


def test_one_dimensional_input_is_one_sequence() -> None:
    req = request_for([5, 6, 7])
    assert list(req.input_ids.shape) == [1, 3]
    assert wire_ids(req).tolist() == [[5, 6, 7]]
    assert list(request_for(np.array([5, 6, 7])).input_ids.shape) == [1, 3]


def test_rectangular_list_of_lists() -> None:
    req = request_for([[5, 6, 7, 8, 9, 10, 11, 12]])
    assert req.input_ids.dtype == pb.DTYPE_INT64
    assert list(req.input_ids.shape) == [1, 8]
    assert list(req.lengths) == []


def test_ragged_lists_become_flat_ids_and_lengths() -> None:
    req = request_for([[1, 2, 3], [4], [5, 6]])
    assert list(req.input_ids.shape) == [6]
    assert wire_ids(req).tolist() == [1, 2, 3, 4, 5, 6]
    assert list(req.lengths) == [3, 1, 2]
    assert req.ragged_layout == pb.RAGGED_LAYOUT_PADDED


def test_ragged_rows_of_mixed_int_dtypes_widen_to_int64() -> None:
    rows = [np.array([1, 2], np.int32), np.array([2**40], np.int64), np.array([7], np.uint8)]
    req = request_for(rows)
    assert req.input_ids.dtype == pb.DTYPE_INT64
    assert wire_ids(req).tolist() == [1, 2, 2**40, 7]
    assert list(req.lengths) == [2, 1, 1]


def test_int32_rows_stay_int32() -> None:
    rows = [np.array([1, 2], np.int32), np.array([3], np.int32)]
    assert request_for(rows).input_ids.dtype == pb.DTYPE_INT32


def test_non_contiguous_array_is_sent_in_logical_order() -> None:
    base = np.arange(24, dtype=np.int64).reshape(4, 6)
    view = base[::2, ::3]
    assert wire_ids(request_for(view)).tolist() == view.tolist()
    assert wire_ids(request_for(base.T)).tolist() == base.T.tolist()


class ArrayLike:
    """Something with __array__ and nothing else, as a torch tensor is to numpy."""

    def __init__(self, data: list[list[int]]) -> None:
        self.data = data
        self.called = 0

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        self.called += 1
        return np.array(self.data, dtype=np.int32)


def test_objects_with_array_protocol() -> None:
    obj = ArrayLike([[3, 4, 5]])
    req = request_for(obj)
    assert obj.called >= 1
    assert req.input_ids.dtype == pb.DTYPE_INT32
    assert wire_ids(req).tolist() == [[3, 4, 5]]


def test_list_of_array_like_rows_can_be_ragged() -> None:
    req = request_for([ArrayLike([[1, 2]]).__array__()[0], ArrayLike([[3]]).__array__()[0]])
    assert list(req.lengths) == [2, 1]


def test_flat_layout_turns_rectangular_into_equal_lengths() -> None:
    req = request_for([[1, 2, 3], [4, 5, 6]], layout="flat")
    assert list(req.input_ids.shape) == [6]
    assert list(req.lengths) == [3, 3]
    assert req.ragged_layout == pb.RAGGED_LAYOUT_FLAT


def test_output_dtype_and_fields() -> None:
    req = request_for([[1]], dtype="float16", model_name="m", request_id="r-1")
    assert req.output_dtype == pb.DTYPE_FLOAT16
    assert (req.model_name, req.request_id) == ("m", "r-1")
    assert output_dtype_code(np.float16) == pb.DTYPE_FLOAT16
    assert output_dtype_code(np.dtype("float32")) == pb.DTYPE_FLOAT32


@pytest.mark.parametrize("dtype", ["int8", "float64", "fp32", "bf16", 3])
def test_bad_output_dtype(dtype: Any) -> None:
    with pytest.raises(InvalidInputError, match="float32, float16 or bfloat16"):
        encode_request(encode_ids([[1]]), dtype=dtype)


def test_bad_layout() -> None:
    with pytest.raises(InvalidInputError, match="'padded' or 'flat'"):
        encode_request(encode_ids([[1]]), layout="ragged")


sequences = st.lists(
    st.lists(st.integers(0, 2**40), min_size=1, max_size=12), min_size=1, max_size=8
)


# No deadline: a busy core can stretch one example past Hypothesis's default 200 ms,
# which says nothing about the code under test.
@settings(deadline=None)
@given(sequences)
def test_any_list_of_lists_round_trips(seqs: list[list[int]]) -> None:
    req = request_for(seqs)
    ids = wire_ids(req)
    if req.lengths:
        assert sum(req.lengths) == ids.size
        bounds = np.cumsum(list(req.lengths))[:-1]
        assert [part.tolist() for part in np.split(ids, bounds)] == seqs
    else:
        assert len({len(s) for s in seqs}) == 1
        assert ids.tolist() == seqs


def test_text_that_is_not_unicode_is_refused_before_sending() -> None:
    with pytest.raises(InvalidInputError, match="request_id"):
        encode_request(encode_ids([[1]]), request_id="bad \udc80")
