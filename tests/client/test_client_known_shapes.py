"""Answers of a shape seen before: the answer heads of ``decode.embed_answer`` give exactly
what the full decode gives."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokembed.client import ServerError, decode
from tokembed.client.decode import decode_hidden_states, embed_answer
from tokembed.v1 import embedding_pb2 as pb

from support.replies import response


@pytest.fixture(autouse=True)
def fresh_caches() -> Iterator[None]:
    """Every test starts with no head known (they are process-wide)."""
    decode._answer_heads.clear()
    yield
    decode._answer_heads.clear()


# --- answers


def answer(hs: np.ndarray) -> bytes:
    """An EmbedResponse's bytes as protobuf writes them (the tensor first, as the server
    does)."""
    return response(hs).SerializeToString()


# No deadline: a busy core can stretch one example past Hypothesis's default 200 ms,
# which says nothing about the code under test.
@settings(deadline=None)
@given(
    st.tuples(st.integers(1, 3), st.integers(1, 200), st.integers(1, 70)),
    st.sampled_from(["float32", "float16"]),
    st.integers(0, 2**31 - 1),
)
def test_an_answer_of_a_known_shape_is_what_the_full_decode_gives(
    shape: tuple[int, int, int], dtype: str, seed: int
) -> None:
    decode._answer_heads.clear()
    rng = np.random.default_rng(seed)
    itemsize = np.dtype(dtype).itemsize
    for _ in range(3):  # the first is decoded in full; the others through its head
        hs = rng.standard_normal(shape).astype(dtype)
        raw = answer(hs)
        got = embed_answer(raw, shape[:2], itemsize)
        assert got.shape == hs.shape and got.dtype == hs.dtype
        assert np.array_equal(got, hs) and np.array_equal(got, decode_hidden_states(raw))
        assert not got.flags.writeable
    assert len(decode._answer_heads) == 1


def broken_after_a_good_one() -> list[tuple[str, bytes]]:
    hs = np.arange(2 * 4, dtype=np.float32).reshape(1, 2, 4)
    # The tensor field alone: the known head, then the data.
    head_and_data = pb.EmbedResponse(
        hidden_states=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=hs.shape, data=hs.tobytes())
    ).SerializeToString()
    # The tensor field again after the data: protobuf merges it (its packed shape grows).
    again = pb.EmbedResponse(hidden_states=pb.Tensor(shape=[3], data=b"\0" * 12))
    return [
        ("merged", head_and_data + again.SerializeToString()),
        ("cut short", head_and_data[:-3]),
        ("garbage after", head_and_data + b"\xff\xff\xff"),
    ]


@pytest.mark.parametrize("case", [name for name, _ in broken_after_a_good_one()])
def test_an_answer_that_only_begins_like_a_known_one_gets_the_full_decode(case: str) -> None:
    hs = np.arange(2 * 4, dtype=np.float32).reshape(1, 2, 4)
    embed_answer(answer(hs), (1, 2), 4)  # learns the head
    assert len(decode._answer_heads) == 1
    raw = dict(broken_after_a_good_one())[case]
    assert raw.startswith(decode._answer_heads[((1, 2), 4)].head)
    # Whatever the full decode makes of it (an error here, for each), embed_answer too.
    with pytest.raises(ServerError) as full:
        decode.check_array_shape(decode_hidden_states(raw), (1, 2))
    with pytest.raises(ServerError) as known:
        embed_answer(raw, (1, 2), 4)
    assert str(known.value) == str(full.value)


def test_an_answer_of_another_width_is_decoded_in_full() -> None:
    # The same request shape, answered by a server of another D (a new replica, say).
    narrow = np.ones((1, 2, 4), dtype=np.float32)
    wide = np.full((1, 2, 6), 2.0, dtype=np.float32)
    assert np.array_equal(embed_answer(answer(narrow), (1, 2), 4), narrow)
    assert np.array_equal(embed_answer(answer(wide), (1, 2), 4), wide)
    assert np.array_equal(embed_answer(answer(narrow), (1, 2), 4), narrow)


def test_a_wrong_shape_is_refused_either_way() -> None:
    hs = np.ones((1, 2, 4), dtype=np.float32)
    embed_answer(answer(hs), (1, 2), 4)
    with pytest.raises(ServerError, match="for a request of"):
        embed_answer(answer(np.ones((2, 1, 4), dtype=np.float32)), (1, 2), 4)
