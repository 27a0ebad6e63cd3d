"""EmbedChunked replies -> one array: assembly into a preallocated buffer, and bad streams."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokembed.client import ServerError
from tokembed.client.decode import ChunkAssembler
from tokembed.v1 import embedding_pb2 as pb


def header(shape: tuple[int, ...], dtype: int = pb.DTYPE_FLOAT32) -> pb.EmbedResponse:
    return pb.EmbedResponse(
        hidden_states=pb.Tensor(dtype=dtype, shape=shape),
        lengths=[2, 1],
        timings=pb.Timings(compute_seconds=0.125),
        model_name="m",
        model_version="3",
    )


def chunks(hs: np.ndarray, cuts: list[int], dtype: int = pb.DTYPE_FLOAT32) -> list[bytes]:
    """Wire bytes of a chunked reply: the header, then the data cut at ``cuts``."""
    data = hs.tobytes()
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
    messages = [pb.EmbedChunk(header=header(hs.shape, dtype))]
    messages += [pb.EmbedChunk(data=data[a:b]) for a, b in itertools.pairwise(bounds)]
    return [m.SerializeToString() for m in messages]


def assemble(parts: list[bytes] | list[pb.EmbedChunk]) -> np.ndarray:
    assembler = ChunkAssembler()
    for part in parts:
        assembler.add(part)
    return assembler.result().hidden_states


def test_uneven_chunks_assemble_into_one_array() -> None:
    hs = np.arange(3 * 5 * 7, dtype=np.float32).reshape(3, 5, 7)
    parts = chunks(hs, [1, 2, 3, 100, 101, 333])
    assembler = ChunkAssembler()
    for part in parts:
        assembler.add(part)
    result = assembler.result()
    assert np.array_equal(result.hidden_states, hs)
    assert result.hidden_states.shape == (3, 5, 7)
    assert result.lengths is not None and result.lengths.tolist() == [2, 1]
    assert result.timings.compute_seconds == 0.125
    assert (result.model_name, result.model_version) == ("m", "3")
    # One copy into a buffer the client owns: writable, and sharing nothing with the chunks.
    assert result.hidden_states.flags.writeable
    for part in parts:
        assert not np.shares_memory(result.hidden_states, np.frombuffer(part, np.uint8))


def test_parsed_chunks_and_float16() -> None:
    hs = np.linspace(0, 1, 12).astype(np.float16).reshape(1, 3, 4)
    parts = [pb.EmbedChunk.FromString(p) for p in chunks(hs, [5, 7], pb.DTYPE_FLOAT16)]
    out = assemble(parts)
    assert out.dtype == np.float16
    assert np.array_equal(out, hs)


def test_data_may_share_the_first_message_with_the_header() -> None:
    hs = np.arange(4, dtype=np.float32).reshape(1, 1, 4)
    first = pb.EmbedChunk(header=header(hs.shape), data=hs.tobytes()[:6]).SerializeToString()
    second = pb.EmbedChunk(data=hs.tobytes()[6:]).SerializeToString()
    assert np.array_equal(assemble([first, second]), hs)


# No deadline: a busy core can stretch one example past Hypothesis's default 200 ms,
# which says nothing about the code under test.
@settings(deadline=None)
@given(st.lists(st.integers(0, 4 * 60), max_size=20))
def test_any_split_reassembles_exactly(cuts: list[int]) -> None:
    hs = np.random.default_rng(len(cuts)).standard_normal((3, 4, 5)).astype(np.float32)
    assert np.array_equal(assemble(chunks(hs, cuts)), hs)


def _data(n: int) -> bytes:
    return pb.EmbedChunk(data=b"\x01" * n).SerializeToString()


def _header(shape: tuple[int, ...]) -> bytes:
    return pb.EmbedChunk(header=header(shape)).SerializeToString()


@pytest.mark.parametrize(
    ("parts", "match"),
    [
        ([_data(4), _header((1, 1, 1))], "data before its header"),
        ([_header((1, 1, 2)), _data(4), _data(8)], "more than the 8 bytes"),
        ([_header((1, 1, 2)), _data(4)], "after 4 of 8 bytes"),
        ([_header((1, 1, 1)), _header((1, 1, 1))], "second header"),
        ([], "without a header"),
        ([_data(0)], "without a header"),
        (
            [
                pb.EmbedChunk(
                    header=pb.EmbedResponse(
                        hidden_states=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1], data=b"abcd")
                    )
                ).SerializeToString()
            ],
            "must not carry data",
        ),
        ([pb.EmbedChunk(header=header((1,), dtype=77)).SerializeToString()], "dtype"),
        ([b"\x0a\x05\x01"], "cannot parse"),
    ],
)
def test_broken_chunk_streams(parts: list[bytes], match: str) -> None:
    with pytest.raises(ServerError, match=match) as info:
        assemble(parts)
    assert info.value.reason == "protocol"
