"""The hand-encoded response bytes against the generated protobuf classes.

``wire.py`` writes the tensor field itself to save a copy; these tests prove the bytes
are ordinary protobuf: the generated classes parse them into exactly the message they
would have built themselves, for every shape and dtype the server sends.
"""

from __future__ import annotations

import numpy as np
import pytest

from tokembed.server import inplace_bytes, wire
from tokembed.server.domain import FLAT, PADDED, EmbedOutput, Timings
from tokembed.server.errors import InvalidInput
from tokembed.server.validation import Limits, validate
from tokembed.v1 import embedding_pb2 as pb

WIRE_DTYPE = {np.dtype("float32"): pb.DTYPE_FLOAT32, np.dtype("float16"): pb.DTYPE_FLOAT16}
TIMINGS = Timings(queue_s=0.00125, compute_s=3.5e-5, batch_requests=300, batch_tokens=70000)

SHAPES = [
    (1, 1, 1),
    (1, 8, 64),
    (2, 3, 300),  # D needs a two-byte varint
    (3, 130, 200),  # S and D need two bytes; the data length needs three
    (1, 70000, 2),  # S needs three bytes
    (5, 64),  # ragged FLAT answers are [N, D]
]


def make_array(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    rng = np.random.default_rng(sum(shape))
    return rng.standard_normal(shape).astype(dtype)


def make_output(array: np.ndarray, lengths: tuple[int, ...] | None) -> EmbedOutput:
    return EmbedOutput(hidden_states=array, lengths=lengths, timings=TIMINGS)


def expected_response(
    array: np.ndarray, lengths: tuple[int, ...] | None, server_s: float
) -> pb.EmbedResponse:
    """What the generated classes build for the same answer (the reference)."""
    return pb.EmbedResponse(
        hidden_states=pb.Tensor(
            dtype=WIRE_DTYPE[array.dtype], shape=list(array.shape), data=array.tobytes()
        ),
        lengths=list(lengths or ()),
        timings=pb.Timings(
            queue_seconds=TIMINGS.queue_s,
            compute_seconds=TIMINGS.compute_s,
            server_seconds=server_s,
            batch_requests=TIMINGS.batch_requests,
            batch_tokens=TIMINGS.batch_tokens,
        ),
        model_name="small",
        model_version="1.2.3",
        request_id="req-7",
    )


def encode(array: np.ndarray, lengths: tuple[int, ...] | None) -> bytes:
    metadata = wire.response_metadata(make_output(array, lengths), "small", "1.2.3", "req-7", 0.25)
    return wire.encode_response(array, metadata)


def assert_same_response(got: pb.EmbedResponse, want: pb.EmbedResponse) -> None:
    # Field by field first (a readable failure), then the whole message.
    assert got.hidden_states.dtype == want.hidden_states.dtype
    assert list(got.hidden_states.shape) == list(want.hidden_states.shape)
    assert got.hidden_states.data == want.hidden_states.data
    assert list(got.lengths) == list(want.lengths)
    assert got.timings == want.timings
    assert (got.model_name, got.model_version, got.request_id) == (
        want.model_name,
        want.model_version,
        want.request_id,
    )
    assert got == want


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_encoded_response_parses_into_the_same_message(shape: tuple[int, ...], dtype: str) -> None:
    array = make_array(shape, dtype)
    lengths = (2, 3) if len(shape) == 2 else None
    parsed = pb.EmbedResponse.FromString(encode(array, lengths))
    want = expected_response(array, lengths, 0.25)
    assert_same_response(parsed, want)
    got = np.frombuffer(parsed.hidden_states.data, dtype=dtype).reshape(shape)
    np.testing.assert_array_equal(got, array)


def test_response_with_ragged_lengths_and_with_none() -> None:
    array = make_array((2, 4, 16), "float32")
    with_lengths = pb.EmbedResponse.FromString(encode(array, (4, 1)))
    assert list(with_lengths.lengths) == [4, 1]
    without = pb.EmbedResponse.FromString(encode(array, None))
    assert list(without.lengths) == []
    assert_same_response(without, expected_response(array, None, 0.25))


def test_response_parses_the_same_as_the_reference_serialisation() -> None:
    array = make_array((2, 3, 300), "float16")
    reference = expected_response(array, (1, 2), 0.25).SerializeToString()
    assert pb.EmbedResponse.FromString(encode(array, (1, 2))) == pb.EmbedResponse.FromString(
        reference
    )


@pytest.mark.parametrize(
    ("lengths", "timings", "server_s", "names"),
    [
        ((2, 3), TIMINGS, 0.25, ("small", "1.2.3", "req-7")),
        (None, Timings(0.0, 0.0, 0, 0), 0.0, ("", "", "")),  # every field at its default
        ((1,), Timings(0.0, 1e-9, 1, 1), 3.0, ("modèle", "v1", "ré")),  # UTF-8 strings
        ((300, 20000), Timings(-0.5, 2.0**40, 2**31, 2**63), 1e-300, ("m", "", "x" * 200)),
    ],
    ids=["typical", "defaults", "unicode", "extremes"],
)
def test_metadata_bytes_are_what_protobuf_writes(
    lengths: tuple[int, ...] | None, timings: Timings, server_s: float, names: tuple[str, ...]
) -> None:
    # Byte for byte: protobuf writes fields in number order and leaves defaults out.
    output = EmbedOutput(hidden_states=make_array((1, 1, 1), "float32"), lengths=lengths,
                         timings=timings)  # fmt: skip
    reference = pb.EmbedResponse(
        lengths=list(lengths or ()),
        timings=pb.Timings(
            queue_seconds=timings.queue_s, compute_seconds=timings.compute_s,
            server_seconds=server_s, batch_requests=timings.batch_requests,
            batch_tokens=timings.batch_tokens,
        ),
        model_name=names[0], model_version=names[1], request_id=names[2],
    )  # fmt: skip
    got = wire.response_metadata(output, names[0], names[1], names[2], server_s)
    assert got == reference.SerializeToString()


@pytest.mark.parametrize("shape", [s for s in SHAPES if len(s) == 3], ids=str)
def test_a_response_joined_from_row_pieces_is_the_encoded_one(shape: tuple[int, ...]) -> None:
    """What the plain path sends (rows as slices of a table's bytes) is byte for byte
    what encode_response writes for the same array."""
    array = make_array(shape, "float32")
    rows = array.reshape(-1, shape[-1])
    pieces = [row.data for row in rows]
    metadata = wire.answer_metadata(TIMINGS, None, "small", "1.2.3", "req-7", 0.25)
    assert metadata == wire.response_metadata(make_output(array, None), "small", "1.2.3",
                                              "req-7", 0.25)  # fmt: skip
    joined = wire.encode_rows_response(shape, pieces, metadata)
    assert joined == wire.encode_response(array, metadata)


def test_non_contiguous_array_is_refused() -> None:
    array = make_array((4, 8), "float32")[:, ::2]
    metadata = wire.response_metadata(make_output(array, None), "m", "1", "", 0.0)
    with pytest.raises(ValueError, match="contiguous"):
        wire.encode_response(array, metadata)


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 16383, 16384, 2**32, 2**63 - 1, 2**64 - 1])
def test_varint_matches_protobuf(value: int) -> None:
    # Timings.batch_tokens (uint64, field 5): one key byte 0x28, then the varint.
    reference = pb.Timings(batch_tokens=value).SerializeToString()
    if value == 0:
        assert reference == b""  # proto3 omits zeros; the varint is still one byte
        assert wire.varint(0) == b"\x00"
    else:
        assert reference == b"\x28" + wire.varint(value)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_stream_answer_wraps_the_response(dtype: str) -> None:
    array = make_array((3, 130, 200), dtype)
    answer = pb.EmbedStreamResponse.FromString(wire.encode_stream_answer(encode(array, None)))
    assert answer.WhichOneof("result") == "response"
    assert_same_response(answer.response, expected_response(array, None, 0.25))


def test_stream_error() -> None:
    answer = pb.EmbedStreamResponse.FromString(
        wire.encode_stream_error(3, "input_ids[0,1] = -1", "invalid_input")
    )
    assert answer.WhichOneof("result") == "error"
    assert (answer.error.code, answer.error.message) == (3, "input_ids[0,1] = -1")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("step", [1000, 4096, 1 << 20])
def test_chunks_carry_the_header_then_the_bytes_in_order(dtype: str, step: int) -> None:
    array = make_array((3, 130, 200), dtype)
    metadata = wire.response_metadata(make_output(array, (1, 2)), "small", "1.2.3", "req-7", 0.25)
    header = pb.EmbedChunk.FromString(wire.encode_chunk_header(array, metadata))
    assert header.HasField("header") and header.data == b""
    want = expected_response(array, (1, 2), 0.25)
    want.hidden_states.data = b""
    assert_same_response(header.header, want)

    flat = array.data.cast("B")
    pieces = []
    for offset in range(0, array.nbytes, step):
        chunk = pb.EmbedChunk.FromString(wire.encode_chunk_data(flat[offset : offset + step]))
        assert not chunk.HasField("header")
        pieces.append(chunk.data)
    assert all(len(p) == step for p in pieces[:-1])
    assert b"".join(pieces) == array.tobytes()


# --- requests: protobuf -> domain


def test_to_domain_copies_every_field() -> None:
    ids = np.array([5, 6, 7], dtype="<i8")
    message = pb.EmbedRequest(
        input_ids=pb.Tensor(dtype=pb.DTYPE_INT64, shape=[3], data=ids.tobytes()),
        lengths=[1, 2],
        output_dtype=pb.DTYPE_FLOAT16,
        ragged_layout=pb.RAGGED_LAYOUT_FLAT,
        model_name="small",
        request_id="abc",
    )
    got = wire.to_domain(message)
    assert got.ids_dtype == "int64"
    assert got.shape == (3,)
    assert got.data == ids.tobytes()
    assert got.lengths == (1, 2)
    assert got.output_dtype == "float16"
    assert got.layout == FLAT
    assert (got.model_name, got.request_id) == ("small", "abc")


@pytest.mark.parametrize(
    ("field", "value", "name"),
    [
        ("ids", pb.DTYPE_INT64, "int64"),
        ("ids", pb.DTYPE_INT32, "int32"),
        ("ids", pb.DTYPE_UNSPECIFIED, "DTYPE_UNSPECIFIED"),
        ("ids", pb.DTYPE_FLOAT32, "DTYPE_FLOAT32"),
        ("ids", 42, "42 (unknown DType value)"),
        ("output", pb.DTYPE_UNSPECIFIED, "float32"),
        ("output", pb.DTYPE_FLOAT32, "float32"),
        ("output", pb.DTYPE_FLOAT16, "float16"),
        ("output", pb.DTYPE_INT32, "DTYPE_INT32"),
        ("output", 9, "9 (unknown DType value)"),
        ("layout", pb.RAGGED_LAYOUT_UNSPECIFIED, PADDED),
        ("layout", pb.RAGGED_LAYOUT_PADDED, PADDED),
        ("layout", pb.RAGGED_LAYOUT_FLAT, FLAT),
        ("layout", 7, "7 (unknown RaggedLayout value)"),
    ],
)
def test_to_domain_maps_enums_including_unknown_values(field: str, value: int, name: str) -> None:
    message = pb.EmbedRequest(input_ids=pb.Tensor(dtype=pb.DTYPE_INT64, shape=[1, 1]))
    if field == "ids":
        message.input_ids.dtype = value  # type: ignore[assignment]
        assert wire.to_domain(message).ids_dtype == name
    elif field == "output":
        message.output_dtype = value  # type: ignore[assignment]
        assert wire.to_domain(message).output_dtype == name
    else:
        message.ragged_layout = value  # type: ignore[assignment]
        assert wire.to_domain(message).layout == name


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"input_ids": pb.Tensor(dtype=42, shape=[1, 1], data=bytes(8))}, "dtype 42 (unknown"),
        (
            {"input_ids": pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 1], data=bytes(8))},
            "dtype DTYPE_FLOAT32 is not supported",
        ),
        ({"output_dtype": 9}, "output_dtype 9 (unknown DType value)"),
        ({"lengths": [1], "ragged_layout": 7}, "ragged_layout 7 (unknown RaggedLayout value)"),
    ],
)
def test_unknown_enum_values_are_named_in_the_validation_error(
    fields: dict[str, object], fragment: str
) -> None:
    fields.setdefault(
        "input_ids",
        pb.Tensor(
            dtype=pb.DTYPE_INT64,
            shape=[1] if "lengths" in fields else [1, 1],
            data=bytes(8),
        ),
    )
    limits = Limits(
        vocab_size=10,
        d_model=4,
        model_name="m",
        max_tokens_per_request=10,
        max_output_bytes_per_request=1000,
    )
    with pytest.raises(InvalidInput) as error:
        validate(wire.to_domain(pb.EmbedRequest(**fields)), limits)  # type: ignore[arg-type]
    assert fragment in str(error.value)


# --- InPlaceResponse: the same bytes as encode_response, the rows written in place


def _in_place(array: np.ndarray, metadata: bytes) -> bytes | None:
    response = wire.InPlaceResponse(array.shape, array.dtype, len(metadata))
    response.rows[...] = array  # what the look-up does: fill every row
    return response.finish(metadata)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_in_place_response_is_byte_for_byte_the_encoded_one(
    shape: tuple[int, ...], dtype: str
) -> None:
    array = make_array(shape, dtype)
    lengths = (2, 3) if len(shape) == 2 else None
    metadata = wire.response_metadata(make_output(array, lengths), "small", "1.2.3", "req-7", 0.25)
    payload = _in_place(array, metadata)
    assert type(payload) is bytes
    assert payload == wire.encode_response(array, metadata)
    assert_same_response(
        pb.EmbedResponse.FromString(payload), expected_response(array, lengths, 0.25)
    )


def test_in_place_response_declines_metadata_of_another_size() -> None:
    # Sized for non-zero timings; a zero duration is left out of the message, so the
    # real metadata is shorter: finish says so, and the caller copies instead.
    array = make_array((2, 3, 8), "float32")
    sized = wire.response_metadata(make_output(array, None), "m", "1", "", 0.25)
    zero_server_s = wire.response_metadata(make_output(array, None), "m", "1", "", 0.0)
    response = wire.InPlaceResponse(array.shape, array.dtype, len(sized))
    response.rows[...] = array
    assert response.finish(zero_server_s) is None
    assert response.rows.flags.writeable  # not handed out: the rows may still be read/copied
    assert wire.encode_response(response.rows, zero_server_s) == wire.encode_response(
        array, zero_server_s
    )


def test_finished_in_place_bytes_can_no_longer_be_written() -> None:
    array = make_array((1, 4, 8), "float32")
    metadata = wire.response_metadata(make_output(array, None), "m", "1", "", 0.25)
    response = wire.InPlaceResponse(array.shape, array.dtype, len(metadata))
    response.rows[...] = array
    payload = response.finish(metadata)
    assert payload is not None
    with pytest.raises(ValueError, match="read-only"):
        response.rows[0, 0, 0] = 1.0
    assert pb.EmbedResponse.FromString(payload).hidden_states.data == array.tobytes()


def test_spare_bytes_declined_once_are_refilled_exactly_for_the_next_answer(
    fresh_allocations: list[int],
) -> None:
    spare = inplace_bytes.SpareBytes()
    array = make_array((2, 3, 8), "float32")
    sized = wire.response_metadata(make_output(array, None), "m", "1", "r", 0.25)
    zero_server_s = wire.response_metadata(make_output(array, None), "m", "1", "r", 0.0)
    declined = wire.InPlaceResponse(array.shape, array.dtype, len(sized), spare.allocate)
    declined.rows[...] = array
    assert declined.finish(zero_server_s) is None  # the caller copies instead
    del declined
    other = -array
    response = wire.InPlaceResponse(array.shape, array.dtype, len(sized), spare.allocate)
    response.rows[...] = other
    payload = response.finish(sized)
    assert len(fresh_allocations) == 1  # the second response reused the first one's bytes
    assert payload == wire.encode_response(other, sized)  # nothing of the first is left


def _request(ids: np.ndarray, dtype: int = pb.DTYPE_INT64, **fields: object) -> pb.EmbedRequest:
    tensor = pb.Tensor(dtype=dtype, shape=ids.shape, data=ids.tobytes())
    return pb.EmbedRequest(input_ids=tensor, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("output_dtype", [pb.DTYPE_UNSPECIFIED, pb.DTYPE_FLOAT32])
def test_the_plain_request_is_read_without_the_domain_objects(output_dtype: int) -> None:
    ids = np.arange(24, dtype="<i8").reshape(3, 8)
    parsed = wire.parse_request(
        _request(ids, output_dtype=output_dtype, request_id="r").SerializeToString()
    )
    assert wire.plain_ids(parsed) == (ids.tobytes(), 3, 8)


PLAIN_OR_NOT = {
    # [B, S] with lengths is refused by validation: it must not be answered here.
    "lengths": _request(np.ones((1, 5), dtype="<i8"), lengths=[5]),
    "a model name": _request(np.ones((1, 2), dtype="<i8"), model_name="small"),
    "a float16 answer": _request(np.ones((1, 2), dtype="<i8"), output_dtype=pb.DTYPE_FLOAT16),
    "an unknown output dtype": _request(np.ones((1, 2), dtype="<i8"), output_dtype=99),
    "int32 ids": _request(np.ones((1, 2), dtype="<i4"), dtype=pb.DTYPE_INT32),
    "one dimension": _request(np.ones(4, dtype="<i8")),
    "three dimensions": _request(np.ones((1, 2, 2), dtype="<i8")),
    "a zero dimension": _request(np.ones((0, 2), dtype="<i8")),
    "negative dimensions": pb.EmbedRequest(
        input_ids=pb.Tensor(dtype=pb.DTYPE_INT64, shape=[-1, -8], data=bytes(64))
    ),
}


@pytest.mark.parametrize("case", sorted(PLAIN_OR_NOT))
def test_any_other_request_goes_the_general_way(case: str) -> None:
    parsed = wire.parse_request(PLAIN_OR_NOT[case].SerializeToString())
    assert wire.plain_ids(parsed) is None


def test_a_malformed_request_goes_the_general_way() -> None:
    parsed = wire.parse_request(b"\xff\xff")
    assert isinstance(parsed, wire.MalformedRequest)
    assert wire.plain_ids(parsed) is None
