"""server/edge/v1/responses.py (and the wire format's pieces it writes with, edge/wire.py)
against the generated classes (tokembed.v1.embedding_pb2).

Every message responses.py encodes by hand is compared with what protobuf serialises for
the same content, byte for byte (protobuf writes fields in number order, repeated scalars
packed, implicit-presence zeros left out: deterministic for these messages, which hold no
maps), and parsed back with the generated classes, every field compared. The cases walk
the varint widths of the lengths, dimensions and counts the encoder writes (every width,
1 to 10 bytes, for the varint itself), and its caches (a response's prefix by shape and
dtype, a model's name fields).

The messages built with the generated classes themselves (stream errors, ModelInfo,
ListModelsResponse) are checked field by field against what they describe.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokembed.export.model_dir import ModelDir, load_model_dir
from tokembed.server.backends.base import Backend, LookUp, Rows
from tokembed.server.core import dtypes
from tokembed.server.core.served import BatchLimits, Limits, ServedModel
from tokembed.server.core.types import Answer, Buffer, Timings
from tokembed.server.edge import wire
from tokembed.server.edge.v1 import responses
from tokembed.v1 import embedding_pb2 as pb

from support.fixtures import DECODER_D, DECODER_V, SMALL_D, SMALL_PAD, SMALL_V

WIRE_DTYPE = {np.dtype("<f4"): pb.DTYPE_FLOAT32, np.dtype("<f2"): pb.DTYPE_FLOAT16}
FLOAT32, FLOAT16 = np.dtype("<f4"), np.dtype("<f2")

# Where a varint grows a byte: 2**7, 2**14, ..., 2**63 (and the largest uint64).
VARINT_EDGES = sorted({0, 1, 2**64 - 1} | {2 ** (7 * n) + d for n in range(1, 10) for d in (-1, 0)})
ZERO_TIMINGS = Timings(queue_s=0.0, compute_s=0.0, batch_requests=0, batch_tokens=0)
SOME_TIMINGS = Timings(queue_s=1.5e-4, compute_s=2.25e-3, batch_requests=3, batch_tokens=700)


# The server's dtype row of each numpy type an answer is made of.
SERVER_DTYPE = {row.numpy: row for row in dtypes.OUTPUT_DTYPES.values()}


def encode(
    answer: Answer, model_name: str, model_version: str, request_id: str, server_s: float
) -> bytes:
    """``responses.embed_response`` of ``answer`` as model ``model_name`` ``model_version``
    answers it (an answer carries its model's name and version)."""
    answer.model_name, answer.model_version = model_name, model_version
    return responses.embed_response(answer, request_id, server_s)


def chunked(
    answer: Answer,
    model_name: str,
    model_version: str,
    request_id: str,
    server_s: float,
    chunk_bytes: int,
) -> list[bytes]:
    """Every message of an EmbedChunked answer, as the sink writes them: the header, then
    the slices."""
    answer.model_name, answer.model_version = model_name, model_version
    header = responses.chunk_header(answer, request_id, server_s)
    return [header, *responses.chunk_slices(answer.pieces, chunk_bytes)]


def answer_of(
    array: np.ndarray,
    *,
    pieces: Sequence[Buffer] | None = None,
    lengths: tuple[int, ...] | None = None,
    timings: Timings = SOME_TIMINGS,
    shape: tuple[int, ...] | None = None,
) -> Answer:
    """An ``Answer`` holding ``array``'s bytes, as ``pieces`` when given (by default one
    byte-format view of the array, as the backends hand out)."""
    data = array.tobytes()
    if pieces is None:
        pieces = [memoryview(np.ascontiguousarray(array)).cast("B")] if array.size else []
    assert b"".join(pieces) == data, "this is a bug in the test: pieces are not the array"
    return Answer(
        shape=array.shape if shape is None else shape,
        dtype=SERVER_DTYPE[array.dtype],
        pieces=pieces,
        lengths=lengths,
        timings=timings,
        tokens=int(np.prod(array.shape[:-1])) if array.ndim else 0,
        nbytes=len(data),
        model_name="",
        model_version="",
    )


def reference_response(
    answer: Answer,
    model_name: str,
    model_version: str,
    request_id: str,
    server_s: float,
    *,
    with_data: bool = True,
) -> pb.EmbedResponse:
    """The same content as an ``EmbedResponse`` of the generated classes (the tensor's data
    left out when ``with_data`` is False: a chunked answer's header)."""
    data = b"".join(answer.pieces) if with_data else b""
    message = pb.EmbedResponse(
        hidden_states=pb.Tensor(
            dtype=WIRE_DTYPE[answer.dtype.numpy], shape=answer.shape, data=data
        ),
        lengths=answer.lengths or (),
        model_name=model_name,
        model_version=model_version,
        request_id=request_id,
    )
    message.timings.SetInParent()  # present even when every field is zero
    message.timings.queue_seconds = answer.timings.queue_s
    message.timings.compute_seconds = answer.timings.compute_s
    message.timings.server_seconds = server_s
    message.timings.batch_requests = answer.timings.batch_requests
    message.timings.batch_tokens = answer.timings.batch_tokens
    return message


def assert_response_fields(
    parsed: pb.EmbedResponse,
    answer: Answer,
    model_name: str,
    model_version: str,
    request_id: str,
    server_s: float,
    *,
    with_data: bool = True,
) -> None:
    """Every field of a parsed ``EmbedResponse`` is what was encoded."""
    tensor = parsed.hidden_states
    assert parsed.HasField("hidden_states")
    assert tensor.dtype == WIRE_DTYPE[answer.dtype.numpy]
    assert tuple(tensor.shape) == answer.shape
    if with_data:
        assert tensor.data == b"".join(answer.pieces)
    else:
        assert tensor.data == b""
    assert tuple(parsed.lengths) == (answer.lengths or ())
    assert parsed.HasField("timings")
    timings = parsed.timings
    assert timings.queue_seconds == answer.timings.queue_s
    assert timings.compute_seconds == answer.timings.compute_s
    assert timings.server_seconds == server_s
    assert timings.batch_requests == answer.timings.batch_requests
    assert timings.batch_tokens == answer.timings.batch_tokens
    assert parsed.model_name == model_name
    assert parsed.model_version == model_version
    assert parsed.request_id == request_id


def check_embed_response(
    answer: Answer,
    model_name: str = "small",
    model_version: str = "1",
    request_id: str = "req-1",
    server_s: float = 0.004,
) -> bytes:
    """``embed_response`` is byte for byte protobuf's, and parses back field for field."""
    encoded = encode(answer, model_name, model_version, request_id, server_s)
    want = reference_response(answer, model_name, model_version, request_id, server_s)
    assert encoded == want.SerializeToString(deterministic=True)
    parsed = pb.EmbedResponse.FromString(encoded)
    assert_response_fields(parsed, answer, model_name, model_version, request_id, server_s)
    # Twice: the second takes the cached prefix and name fields.
    assert encode(answer, model_name, model_version, request_id, server_s) == (encoded)
    return encoded


def read_varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at ``data[at:]`` and where it ends (read here, not by responses.py)."""
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def rows(shape: tuple[int, ...], dtype: np.dtype, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# --- varints


def protobuf_varint(value: int) -> bytes:
    """``value`` as protobuf writes a varint: Timings.batch_tokens (field 5, uint64) is one
    key byte then the varint, left out when 0; ModelInfo.padding_id (field 6, optional)
    is written even when 0."""
    if value == 0:
        serialised = pb.ModelInfo(padding_id=0).SerializeToString()
        assert serialised[0] == 6 << 3
    else:
        serialised = pb.Timings(batch_tokens=value).SerializeToString()
        assert serialised[0] == 5 << 3
    return serialised[1:]


@pytest.mark.parametrize("value", VARINT_EDGES)
def test_varint_is_protobuf_s_at_every_width(value: int) -> None:
    assert wire.varint(value) == protobuf_varint(value)
    assert len(wire.varint(value)) == max(1, math.ceil(value.bit_length() / 7))


@settings(deadline=None)
@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_varint_matches_protobuf_for_any_uint64(value: int) -> None:
    assert wire.varint(value) == protobuf_varint(value)


def test_varint_of_a_negative_number_is_a_bug() -> None:
    with pytest.raises(ValueError, match="this is a bug"):
        wire.varint(-1)


# --- EmbedResponse (Embed), and the stream item around it (EmbedStream)


@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT16], ids=["float32", "float16"])
@pytest.mark.parametrize(
    "shape",
    [
        (1, 1, 1),
        (1, 1, SMALL_D),
        (2, 3, SMALL_D),
        (1, 127, 1),  # dims at the edge of one varint byte
        (1, 128, 1),
        (129, 2),
        (1, 16383, 1),  # ... and of two
        (1, 16384, 1),
        (16385, 1),
        (1, 2**20, 2),  # dims needing three and four bytes
        (2**21, 1),
    ],
)
def test_embed_response_is_protobuf_s_bytes(shape: tuple[int, ...], dtype: np.dtype) -> None:
    check_embed_response(answer_of(rows(shape, dtype)))


@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT16], ids=["float32", "float16"])
@pytest.mark.parametrize(
    "nbytes",
    [
        4, 124, 128, 132,  # the data's length varint: 1 -> 2 bytes
        16380, 16384, 16388,  # 2 -> 3 bytes
        2**21 - 4, 2**21, 2**21 + 4,  # 3 -> 4 bytes
    ],
)  # fmt: skip
def test_embed_response_at_every_length_width(nbytes: int, dtype: np.dtype) -> None:
    encoded = check_embed_response(answer_of(rows((1, nbytes // dtype.itemsize, 1), dtype)))
    assert encoded[0] == 1 << 3 | 2  # the tensor first


def test_every_tensor_length_across_the_one_to_two_byte_edge() -> None:
    # The tensor field's length is its header (dtype, shape, the data's key and length)
    # plus the data: it crosses 127/128 a few data bytes before the data's length does.
    # Two-byte values in shapes of two and three dimensions reach every length.
    tensor_lengths = set()
    for count in range(50, 70):
        for shape in ((1, count, 1), (count, 1)):
            encoded = check_embed_response(answer_of(rows(shape, FLOAT16)))
            tensor_lengths.add(read_varint(encoded, 1)[0])
    assert {126, 127, 128, 129} <= tensor_lengths


def test_empty_strings_and_zero_timings_are_left_out_but_timings_is_always_there() -> None:
    answer = answer_of(rows((1, 1, 2), FLOAT32), timings=ZERO_TIMINGS)
    encoded = check_embed_response(answer, "", "", "", 0.0)
    tensor_field_length = 2 + encoded[1]
    assert encoded[tensor_field_length:] == b"\x1a\x00"  # timings, empty; nothing else
    parsed = pb.EmbedResponse.FromString(encoded)
    assert parsed.HasField("timings") and parsed.timings.ByteSize() == 0


@pytest.mark.parametrize(
    "timings",
    [
        Timings(queue_s=0.0, compute_s=1e-9, batch_requests=0, batch_tokens=1),
        Timings(queue_s=5e-324, compute_s=0.0, batch_requests=1, batch_tokens=0),  # subnormal
        Timings(queue_s=1e300, compute_s=math.inf, batch_requests=2**32 - 1,
                batch_tokens=2**64 - 1),
        Timings(queue_s=0.25, compute_s=0.5, batch_requests=127, batch_tokens=128),
        Timings(queue_s=0.25, compute_s=0.5, batch_requests=16384, batch_tokens=16383),
    ],
)  # fmt: skip
@pytest.mark.parametrize("server_s", [0.0, 1e-6, 3.75])
def test_timings_each_field_present_or_left_out_as_protobuf_does(
    timings: Timings, server_s: float
) -> None:
    check_embed_response(answer_of(rows((2, 2, 3), FLOAT32), timings=timings), server_s=server_s)


@pytest.mark.parametrize(
    ("model_name", "model_version", "request_id"),
    [
        ("modèle", "v2-β", "запрос-1"),
        ("埋め込み", "", "🙂" * 3),
        ("", "1", ""),
        ("m" * 127, "v" * 128, "r" * 16384),  # string lengths across the varint edges
        ("é" * 64, "😀" * 32, "ü" * 8192),  # 128, 128 and 16384 bytes of UTF-8
        ("é" * 63 + "a", "x" * 16383, "y" * 2**21),
    ],
)
def test_model_names_and_request_ids_in_utf_8(
    model_name: str, model_version: str, request_id: str
) -> None:
    check_embed_response(answer_of(rows((1, 2, 4), FLOAT16)), model_name, model_version, request_id)


@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT16], ids=["float32", "float16"])
@pytest.mark.parametrize(
    "lengths",
    [
        (1,),
        (3, 1, 2),
        (127, 128, 1),  # each length's own varint at its edge
        (16383, 16384),
        (1,) * 127,  # the packed lengths' length: 127 and 128 bytes
        (1,) * 128,
        (200,) * 64,  # 128 bytes of two-byte lengths
        (1,) * 16384,  # ... and 16384 bytes
    ],
)
def test_ragged_answers_padded_and_flat(lengths: tuple[int, ...], dtype: np.dtype) -> None:
    total, longest = sum(lengths), max(lengths)
    d_model = 2
    flat = rows((total, d_model), dtype)
    # Flat: [N, D], the rows one sequence after another, in pieces per sequence.
    starts = np.cumsum((0, *lengths))
    pieces = [flat[a:b].tobytes() for a, b in itertools.pairwise(starts)]
    check_embed_response(answer_of(flat, pieces=pieces, lengths=lengths))
    if len(lengths) * longest * d_model > 2**22:
        return  # padded would be too large to be worth the time
    # Padded: [B, S_max, D], each sequence's rows then padding rows, a piece each.
    padded = np.zeros((len(lengths), longest, d_model), dtype)
    pad = np.full((1, d_model), 7, dtype).tobytes()
    pieces = []
    for b, (a, stop) in enumerate(itertools.pairwise(starts)):
        padded[b, : stop - a] = flat[a:stop]
        padded[b, stop - a :] = 7
        pieces += [flat[a:stop].tobytes(), *[pad] * (longest - (stop - a))]
    check_embed_response(answer_of(padded, pieces=pieces, lengths=lengths))


def test_pieces_of_every_kind_and_size_join_in_order() -> None:
    array = rows((3, 5, 4), FLOAT32)
    data = memoryview(array).cast("B")
    cut = [data[:1], data[1:17], b"", bytes(data[17:100]), data[100:100], data[100:]]
    check_embed_response(answer_of(array, pieces=cut))


def test_the_same_shape_in_two_dtypes_gets_each_its_own_prefix() -> None:
    # The prefix cache is keyed by shape and dtype: float16 must not reuse float32's.
    for dtype in (FLOAT32, FLOAT16, FLOAT32, FLOAT16):
        check_embed_response(answer_of(rows((2, 130, 3), dtype)))


def test_dimensions_past_every_cached_varint_frame_the_data_given() -> None:
    """The framing takes the shape and the data as given (an answer's shape always fits its
    data; protobuf does not care): dimensions up to 2**63, here with a few bytes of data,
    still frame exactly as protobuf does."""
    data = rows((1, 1, 4), FLOAT32)
    for shape in [(2**28, 1, 1), (1, 2**35, 3), (2**63 - 1, 1, 1), (2**49, 2**14, 2**7)]:
        check_embed_response(answer_of(data, shape=shape))


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 300, SMALL_D), (1, 16384, 1)])
def test_stream_answer_wraps_the_response_as_protobuf_does(shape: tuple[int, ...]) -> None:
    answer = answer_of(rows(shape, FLOAT32))
    inner = encode(answer, "small", "1", "r", 0.5)
    item = responses.stream_answer(inner)
    want = pb.EmbedStreamResponse(response=reference_response(answer, "small", "1", "r", 0.5))
    assert item == want.SerializeToString(deterministic=True)
    parsed = pb.EmbedStreamResponse.FromString(item)
    assert parsed.WhichOneof("result") == "response"
    assert_response_fields(parsed.response, answer, "small", "1", "r", 0.5)


@pytest.mark.parametrize(
    ("code", "message", "reason"),
    [
        (3, "input_ids[0,1] = -1 is outside the vocabulary [0, 1000)", "invalid_input"),
        (8, "overloaded: 9 queued tokens", "overloaded"),
        (13, "internal error: ✗ cast exploded", "internal"),
        (5, "model 'ﾓﾃﾞﾙ' is not served here", "not_found"),
        (0, "", ""),  # all three at their zero: an empty Error, still the chosen result
        (2**31 - 1, "m" * 200, "r" * 128),
    ],
)
def test_stream_error_is_the_error_of_the_stream_item(code: int, message: str, reason: str) -> None:
    item = responses.stream_error(code, message, reason)
    want = pb.EmbedStreamResponse(error=pb.Error(code=code, message=message, reason=reason))
    assert item == want.SerializeToString(deterministic=True)
    parsed = pb.EmbedStreamResponse.FromString(item)
    assert parsed.WhichOneof("result") == "error"
    assert (parsed.error.code, parsed.error.message, parsed.error.reason) == (
        code,
        message,
        reason,
    )


# --- EmbedChunked


def check_chunks(answer: Answer, chunk_bytes: int, request_id: str = "chunked") -> list[bytes]:
    """``chunked_response``: a header chunk byte for byte protobuf's, then data chunks each
    byte for byte protobuf's, every one ``chunk_bytes`` long but the last, together the
    tensor's bytes in order."""
    chunks = chunked(answer, "small", "1", request_id, 0.125, chunk_bytes)
    header = reference_response(answer, "small", "1", request_id, 0.125, with_data=False)
    assert chunks[0] == pb.EmbedChunk(header=header).SerializeToString(deterministic=True)
    first = pb.EmbedChunk.FromString(chunks[0])
    assert first.HasField("header") and first.data == b""
    assert_response_fields(first.header, answer, "small", "1", request_id, 0.125, with_data=False)
    data = b"".join(answer.pieces)
    slices = [data[start : start + chunk_bytes] for start in range(0, len(data), chunk_bytes)]
    assert len(chunks) == 1 + len(slices) == 1 + math.ceil(len(data) / chunk_bytes)
    for chunk, want in zip(chunks[1:], slices, strict=True):
        assert chunk == pb.EmbedChunk(data=want).SerializeToString(deterministic=True)
        parsed = pb.EmbedChunk.FromString(chunk)
        assert not parsed.HasField("header") and parsed.data == want
    return chunks


@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT16], ids=["float32", "float16"])
@pytest.mark.parametrize(
    ("total", "chunk_bytes"),
    [
        (64, 64),  # exactly one chunk
        (64, 65),
        (128, 64),  # exactly two
        (130, 64),  # two and a short one
        (126, 64),
        (2, 1),  # one byte a chunk
        (16384, 128),
        (16388, 16384),  # chunk lengths across the varint edges
        (2**21 + 4, 2**20),
        (256 * 1024, 127),
    ],
)
def test_chunks_at_their_boundaries(total: int, chunk_bytes: int, dtype: np.dtype) -> None:
    count = total // dtype.itemsize
    check_chunks(answer_of(rows((1, count, 1), dtype)), chunk_bytes)


@pytest.mark.parametrize("chunk_bytes", [1, 3, 8, 16, 17, 64, 4096])
def test_chunks_cut_pieces_larger_than_a_chunk_and_join_small_ones(chunk_bytes: int) -> None:
    array = rows((4, 33, 8), FLOAT16)
    data = memoryview(array).cast("B")
    # One piece of 2000 bytes (many chunks), tiny pieces, empty ones, one of exactly 16.
    cuts = [0, 2000, 2001, 2001, 2003, 2019, 2019, 2035, len(data)]
    pieces = [data[a:b] for a, b in itertools.pairwise(cuts)]
    check_chunks(answer_of(array, pieces=pieces), chunk_bytes)


def test_chunked_header_carries_lengths_names_and_timings() -> None:
    lengths = (3, 128, 1)
    flat = rows((sum(lengths), 5), FLOAT32)
    check_chunks(answer_of(flat, lengths=lengths), 100, request_id="ɹǝbnǝst 🙃")
    check_chunks(answer_of(flat, lengths=lengths, timings=ZERO_TIMINGS), 100, request_id="")


# --- any content


dtypes = st.sampled_from([FLOAT32, FLOAT16])
# Timings are durations: never negative, so never -0.0 (which protobuf writes and the
# encoder, testing ``if value``, leaves out).
durations = st.floats(min_value=0.0, allow_nan=False)
names = st.text(max_size=40)


@st.composite
def answers(draw: st.DrawFn) -> Answer:
    dtype = draw(dtypes)
    lengths = draw(st.none() | st.lists(st.integers(1, 2**40), min_size=1, max_size=40))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=2, max_size=3)))
    array = rows(shape, dtype, seed=draw(st.integers(0, 2**32 - 1)))
    data = memoryview(array).cast("B")
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=6)))
    bounds = [0, *cuts, len(data)]
    pieces = [data[a:b] for a, b in itertools.pairwise(bounds)]
    timings = Timings(
        queue_s=draw(durations),
        compute_s=draw(durations),
        batch_requests=draw(st.integers(0, 2**32 - 1)),
        batch_tokens=draw(st.integers(0, 2**64 - 1)),
    )
    return answer_of(
        array, pieces=pieces, lengths=tuple(lengths) if lengths else None, timings=timings
    )


@settings(deadline=None)
@given(answers(), names, names, names, durations)
def test_any_embed_response_is_protobuf_s_bytes(
    answer: Answer, model_name: str, model_version: str, request_id: str, server_s: float
) -> None:
    encoded = check_embed_response(answer, model_name, model_version, request_id, server_s)
    want = reference_response(answer, model_name, model_version, request_id, server_s)
    item = responses.stream_answer(encoded)
    assert item == pb.EmbedStreamResponse(response=want).SerializeToString(deterministic=True)


@settings(deadline=None)
@given(answers(), st.integers(1, 200), names)
def test_any_chunked_answer_is_protobuf_s_chunks(
    answer: Answer, chunk_bytes: int, request_id: str
) -> None:
    check_chunks(answer, chunk_bytes, request_id)


@settings(deadline=None)
@given(st.integers(0, 2**31 - 1), st.text(max_size=300), st.text(max_size=40))
def test_any_stream_error_parses_back(code: int, message: str, reason: str) -> None:
    item = responses.stream_error(code, message, reason)
    parsed = pb.EmbedStreamResponse.FromString(item)
    assert parsed.WhichOneof("result") == "error"
    assert (parsed.error.code, parsed.error.message, parsed.error.reason) == (
        code,
        message,
        reason,
    )


# --- GetModelInfo and ListModels


class Described(Backend):
    """A backend that only describes itself (model info reads no rows)."""

    def __init__(self, kind: str, d_model: int) -> None:
        self.kind, self.d_model = kind, d_model
        self.execution_provider = "CPUExecutionProvider"

    def look_up(self, request: LookUp) -> Rows:
        raise AssertionError("this is a bug in the test: model info looks nothing up")

    def pad_row(self, dtype: dtypes.DType) -> bytes:
        raise AssertionError("this is a bug in the test: model info pads nothing")


def served(model: ModelDir, backend: str = "table") -> ServedModel:
    manifest = model.manifest
    return ServedModel(
        model=model,
        backend=Described(backend, manifest.d_model),
        limits=Limits(5000, 3 * 2**20),
        batch=BatchLimits(
            max_batch_tokens=16384,
            max_delay_s=0.002,
            max_concurrent_batches=2,
            max_queued_tokens=2**40,
        ),
    )


def assert_model_info(info: pb.ModelInfo, model: ServedModel, max_message_bytes: int) -> None:
    manifest = model.model.manifest
    assert (info.name, info.version) == (manifest.name, manifest.version)
    assert (info.vocab_size, info.d_model) == (manifest.vocab_size, manifest.d_model)
    assert info.scale == manifest.scale
    assert info.HasField("padding_id") == (manifest.padding_idx is not None)
    if manifest.padding_idx is not None:
        assert info.padding_id == manifest.padding_idx
    assert info.weight_dtype == manifest.weight_dtype
    assert list(info.input_dtypes) == [pb.DTYPE_INT64, pb.DTYPE_INT32]
    assert list(info.output_dtypes) == [pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16]
    assert info.execution_provider == model.backend.execution_provider
    assert info.backend == model.backend.kind
    assert info.model_sha256 == model.model.model_sha256 and len(info.model_sha256) == 64
    limits = info.limits
    assert limits.max_tokens_per_request == model.limits.max_tokens_per_request
    assert limits.max_output_bytes_per_request == model.limits.max_output_bytes_per_request
    assert limits.max_batch_tokens == model.batch.max_batch_tokens
    assert limits.max_message_bytes == max_message_bytes
    assert limits.max_delay_seconds == model.batch.max_delay_s


def test_model_info_describes_the_model_and_its_limits(
    small_model_dir: Path, decoder_model_dir: Path
) -> None:
    small = served(load_model_dir(small_model_dir))
    decoder = served(load_model_dir(decoder_model_dir), backend="onnxruntime")
    for model, padding in ((small, SMALL_PAD), (decoder, None)):
        info = responses.model_info(model, 2**33)
        parsed = pb.ModelInfo.FromString(info.SerializeToString())
        assert_model_info(parsed, model, 2**33)
        assert (parsed.padding_id if parsed.HasField("padding_id") else None) == padding
    assert (small.model.manifest.vocab_size, small.model.manifest.d_model) == (SMALL_V, SMALL_D)
    assert (decoder.model.manifest.vocab_size, decoder.model.manifest.d_model) == (
        DECODER_V,
        DECODER_D,
    )


def test_list_models_keeps_the_order_given_and_names_the_default(
    small_model_dir: Path, decoder_model_dir: Path
) -> None:
    models = [
        served(load_model_dir(decoder_model_dir)),
        served(load_model_dir(small_model_dir), backend="onnxruntime"),
    ]
    message = responses.list_models(models, "small", 70 * 2**20)
    parsed = pb.ListModelsResponse.FromString(message.SerializeToString())
    assert parsed.default_model == "small"
    assert [info.name for info in parsed.models] == ["decoder", "small"]
    for info, model in zip(parsed.models, models, strict=True):
        assert_model_info(info, model, 70 * 2**20)
        assert info == responses.model_info(model, 70 * 2**20)
