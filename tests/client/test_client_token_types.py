"""Token type ids, client side and on the wire: what ``embed(ids, token_types=...)`` sends
(one type per id, in the ids' layout), what it refuses before sending, and how the
server's deserializer reads the field back."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tokembed.client import InvalidInputError
from tokembed.client.codec import embed_call
from tokembed.server.core.dataplane import Request
from tokembed.server.edge.v1.requests import parse_embed
from tokembed.v1 import embedding_pb2 as pb

_WIRE_NP = {pb.DTYPE_INT64: "<i8", pb.DTYPE_INT32: "<i4"}


def sent(ids: Any, types: Any, layout: str = "padded") -> pb.EmbedRequest:
    call = embed_call(ids, "float32", layout, token_types=types)
    return pb.EmbedRequest.FromString(call.request)


def tensor(t: pb.Tensor) -> np.ndarray:
    return np.frombuffer(t.data, _WIRE_NP[t.dtype]).reshape(tuple(t.shape))


def test_rectangular_types_travel_in_the_ids_shape() -> None:
    request = sent([[5, 6, 7], [8, 9, 10]], np.array([[0, 0, 1], [1, 1, 0]], dtype=np.int8))
    assert request.HasField("token_type_ids")
    assert tensor(request.token_type_ids).tolist() == [[0, 0, 1], [1, 1, 0]]
    assert list(request.token_type_ids.shape) == list(request.input_ids.shape) == [2, 3]


def test_ragged_and_flat_types_follow_the_ids_layout() -> None:
    ragged = sent([[5, 6, 7], [8]], [[0, 1, 1], [1]])
    assert tensor(ragged.input_ids).tolist() == [5, 6, 7, 8]
    assert tensor(ragged.token_type_ids).tolist() == [0, 1, 1, 1]
    assert list(ragged.lengths) == [3, 1]
    flat = sent([[5, 6], [7, 8]], [[0, 1], [1, 0]], layout="flat")
    assert list(flat.input_ids.shape) == list(flat.token_type_ids.shape) == [4]
    assert tensor(flat.token_type_ids).tolist() == [0, 1, 1, 0]


def test_no_types_sends_no_field() -> None:
    assert not sent([[5, 6]], None).HasField("token_type_ids")


@pytest.mark.parametrize(
    ("ids", "types", "message"),
    [
        ([[5, 6, 7]], [[0, 1]], "ids are [1, 3], token_types [1, 2]"),
        (
            [[5, 6], [7]],
            [[0, 1], [1, 0]],
            "ids are sequences of lengths [2, 1], token_types [2, 2]",
        ),
        ([[5, 6]], [[0.0, 1.0]], "token_types: sequence 0 must be integers"),
        ([[5, 6]], "01", "token_types: ids must be integers"),
    ],
)
def test_types_that_do_not_match_the_ids_are_refused_before_sending(
    ids: Any, types: Any, message: str
) -> None:
    with pytest.raises(InvalidInputError) as error:
        embed_call(ids, "float32", "padded", token_types=types)
    assert message in str(error.value)


def test_the_server_reads_the_field_as_the_kind_s_token_type_ids() -> None:
    call = parse_embed(sent([[5, 6, 7]], np.array([[0, 1, 1]], dtype=np.int32)).SerializeToString())
    assert isinstance(call, Request)
    more = call.body.more_ids
    assert more is not None and list(more) == ["token_type_ids"]
    types = more["token_type_ids"]
    assert (types.dtype, types.shape) == ("int32", (1, 3))
    assert np.frombuffer(types.data, "<i4").tolist() == [0, 1, 1]
    # An unknown dtype is named, for validation to refuse.
    message = pb.EmbedRequest(
        input_ids=pb.Tensor(dtype=pb.DTYPE_INT64, shape=[1], data=bytes(8)),
        token_type_ids=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1], data=bytes(4)),
    )
    call = parse_embed(message.SerializeToString())
    assert isinstance(call, Request) and call.body.more_ids is not None
    assert call.body.more_ids["token_type_ids"].dtype == "DTYPE_FLOAT32"
