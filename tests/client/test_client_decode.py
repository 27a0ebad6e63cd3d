"""Replies -> arrays: zero-copy decoding, the protobuf fallback, and broken replies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokembed.client import (
    EmbeddingError,
    EmbedResult,
    InvalidInputError,
    ModelNotFoundError,
    OverloadedError,
    RequestTooLargeError,
    ServerError,
    UnavailableError,
)
from tokembed.client.decode import (
    ZERO_COPY_MIN_BYTES,
    decode_hidden_states,
    decode_response,
    decode_stream_response,
)
from tokembed.v1 import embedding_pb2 as pb

from support.replies import response


def owner(arr: np.ndarray) -> Any:
    """The object at the end of the array's .base chain (what owns the memory)."""
    base: Any = arr
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base


def test_unary_decode_points_into_the_received_bytes() -> None:
    # Large enough for the zero-copy path (small answers are parsed by protobuf).
    hs = np.arange(2 * 3 * 16384, dtype=np.float32).reshape(2, 3, 16384)
    assert hs.nbytes >= ZERO_COPY_MIN_BYTES
    raw = response(hs).SerializeToString()
    result = decode_response(raw)
    assert np.array_equal(result.hidden_states, hs)
    assert result.hidden_states.dtype == np.float32
    # Zero-copy: the array's memory is the bytes gRPC handed over, not a copy of them.
    assert owner(result.hidden_states) is raw
    assert np.shares_memory(result.hidden_states, np.frombuffer(raw, np.uint8))
    assert not result.hidden_states.flags.writeable  # documented: read-only view
    assert result.timings.queue_seconds == 0.5
    assert result.timings.batch_requests == 3
    assert (result.model_name, result.model_version, result.request_id) == ("m", "2", "rid")
    assert result.lengths is None
    # The array alone (what embed returns) is the same zero-copy view.
    alone = decode_hidden_states(raw)
    assert np.array_equal(alone, hs) and owner(alone) is raw and not alone.flags.writeable


def test_float16_and_lengths() -> None:
    hs = np.linspace(-2, 2, 2 * 3 * 5).astype(np.float16).reshape(2, 3, 5)
    raw = response(hs, lengths=[3, 1]).SerializeToString()
    result = decode_response(raw)
    assert result.hidden_states.dtype == np.float16
    assert np.array_equal(result.hidden_states, hs)
    assert result.lengths is not None
    assert result.lengths.tolist() == [3, 1]
    assert [s.shape for s in result.sequences()] == [(3, 5), (1, 5)]


def test_flat_sequences_split_by_lengths() -> None:
    hs = np.arange(6 * 2, dtype=np.float32).reshape(6, 2)
    result = decode_response(response(hs, lengths=[1, 3, 2]).SerializeToString())
    parts = result.sequences()
    assert [p.shape for p in parts] == [(1, 2), (3, 2), (2, 2)]
    assert np.array_equal(np.concatenate(parts), hs)


def test_parsed_message_decodes_too() -> None:
    hs = np.ones((1, 2, 3), np.float32)
    assert np.array_equal(decode_response(response(hs)).hidden_states, hs)


def test_merged_encoding_falls_back_to_protobuf() -> None:
    # Two serialized halves concatenated are one message to protobuf (fields merge):
    # hidden_states appears twice on the wire. The splice reader must not guess.
    hs = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    part1 = pb.EmbedResponse(hidden_states=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 2, 3]))
    part2 = pb.EmbedResponse(hidden_states=pb.Tensor(data=hs.tobytes()), model_name="m")
    raw = part1.SerializeToString() + part2.SerializeToString()
    result = decode_response(raw)
    assert np.array_equal(result.hidden_states, hs)
    assert result.model_name == "m"


@pytest.mark.parametrize("width", [4, 65536], ids=["protobuf-path", "zero-copy-path"])
def test_unknown_fields_are_ignored(width: int) -> None:
    hs = np.arange(width, dtype=np.float32).reshape(1, 1, width)
    # Field 99 (varint) and field 98 (bytes), as a newer server might add.
    extra = bytes([0x98, 0x06, 0x2A]) + bytes([0x92, 0x06, 0x02]) + b"hi"
    raw = response(hs).SerializeToString() + extra
    result = decode_response(raw)
    assert np.array_equal(result.hidden_states, hs)
    assert (owner(result.hidden_states) is raw) == (len(raw) >= ZERO_COPY_MIN_BYTES)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        # cut inside hidden_states.data
        (response(np.ones((1, 2, 3), np.float32)).SerializeToString()[:20], "EmbedResponse"),
        (
            pb.EmbedResponse(
                hidden_states=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 3], data=b"\0" * 20)
            ).SerializeToString(),
            "needs 24 bytes, got 20",
        ),
        (
            pb.EmbedResponse(
                hidden_states=pb.Tensor(dtype=99, shape=[1], data=b"\0" * 4)
            ).SerializeToString(),
            "not a known dtype",
        ),
        (
            pb.EmbedResponse(
                hidden_states=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-1, 1], data=b"")
            ).SerializeToString(),
            "negative dimension",
        ),
    ],
)
@pytest.mark.parametrize("decode", [decode_response, decode_hidden_states])
def test_broken_replies_raise_protocol_errors(
    raw: bytes, match: str, decode: Callable[[bytes], object]
) -> None:
    with pytest.raises(ServerError, match=match) as info:
        decode(raw)
    assert info.value.reason == "protocol"
    assert info.value.code is None


def test_small_answers_are_parsed_by_protobuf_and_stay_read_only() -> None:
    hs = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    raw = response(hs).SerializeToString()
    result = decode_response(raw)
    assert np.array_equal(result.hidden_states, hs)
    assert owner(result.hidden_states) is not raw
    assert not result.hidden_states.flags.writeable
    assert result.timings.batch_requests == 3
    alone = decode_hidden_states(raw)
    assert np.array_equal(alone, hs) and not alone.flags.writeable


def test_stream_answer_decodes_zero_copy() -> None:
    hs = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
    raw = pb.EmbedStreamResponse(response=response(hs)).SerializeToString()
    outcome = decode_stream_response(raw)
    assert isinstance(outcome, EmbedResult)
    assert np.array_equal(outcome.hidden_states, hs)
    assert owner(outcome.hidden_states) is raw


SC = grpc.StatusCode


@pytest.mark.parametrize(
    ("code", "reason", "cls"),
    [
        (SC.INVALID_ARGUMENT, "invalid_input", InvalidInputError),
        # Both RESOURCE_EXHAUSTED: only the reason tells "never retry" from "retry later".
        (SC.RESOURCE_EXHAUSTED, "too_large", RequestTooLargeError),
        (SC.RESOURCE_EXHAUSTED, "overloaded", OverloadedError),
        (SC.NOT_FOUND, "not_found", ModelNotFoundError),
        (SC.UNAVAILABLE, "unavailable", UnavailableError),
        (SC.INTERNAL, "internal", ServerError),
        # An Error without a reason (a server older than Error.reason): the code's own row,
        # which for RESOURCE_EXHAUSTED is "too large" (never retried).
        (SC.RESOURCE_EXHAUSTED, "", RequestTooLargeError),
        (SC.INVALID_ARGUMENT, "", InvalidInputError),
    ],
)
@pytest.mark.parametrize("parsed", [False, True], ids=["bytes", "message"])
def test_stream_error_reason_picks_the_typed_error(
    code: grpc.StatusCode, reason: str, cls: type[EmbeddingError], parsed: bool
) -> None:
    message = pb.EmbedStreamResponse(
        error=pb.Error(code=code.value[0], message="id -1 at position 3", reason=reason)
    )
    outcome = decode_stream_response(message if parsed else message.SerializeToString())
    assert type(outcome) is cls
    assert isinstance(outcome, EmbeddingError)
    assert (outcome.code, outcome.reason) == (code, reason or None)
    assert outcome.details == "id -1 at position 3"
    assert str(outcome) == (
        f"{code.name} ({reason}): id -1 at position 3"
        if reason
        else f"{code.name}: id -1 at position 3"
    )


def test_stream_answer_with_neither_is_a_protocol_error() -> None:
    with pytest.raises(ServerError, match="neither"):
        decode_stream_response(b"")


# No deadline: a busy core can stretch one example past Hypothesis's default 200 ms,
# which says nothing about the code under test.
@settings(deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    half=st.booleans(),
    data=st.data(),
)
def test_decode_matches_protobuf(shape: list[int], half: bool, data: st.DataObject) -> None:
    dtype = np.float16 if half else np.float32
    count = int(np.prod(shape))
    values = data.draw(st.lists(st.integers(-1000, 1000), min_size=count, max_size=count))
    hs = np.array(values, dtype=dtype).reshape(shape)
    msg = response(hs, lengths=data.draw(st.lists(st.integers(1, 9), max_size=3)))
    raw = msg.SerializeToString()
    ours = decode_response(raw)
    reference = np.frombuffer(msg.hidden_states.data, dtype).reshape(shape)
    assert np.array_equal(ours.hidden_states, reference)
    assert ours.hidden_states.shape == tuple(shape)
    assert np.array_equal(decode_hidden_states(raw), reference)
    assert decode_hidden_states(raw).shape == tuple(shape)
    assert (ours.lengths.tolist() if ours.lengths is not None else []) == list(msg.lengths)
