"""NearestChunked replies (``TensorsChunk``s) -> one array per named tensor: slices that
span tensors' ends reassemble exactly, each tensor in its own preallocated array; broken
streams are protocol errors naming what is wrong."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokembed.client import ServerError
from tokembed.client.decode import TensorsChunkAssembler, nearest_result_of
from tokembed.v1 import embedding_pb2 as pb

IDS = np.arange(12, dtype=np.int64).reshape(3, 4) * 1_000_003
SCORES = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
LOGITS = np.random.default_rng(0).standard_normal((3, 9)).astype(np.float32)
TENSORS = [("ids", IDS, pb.DTYPE_INT64), ("scores", SCORES, pb.DTYPE_FLOAT32),
           ("logits", LOGITS, pb.DTYPE_FLOAT32)]  # fmt: skip
DATA = b"".join(array.tobytes() for _, array, _ in TENSORS)


def _header(tensors: list[tuple[str, np.ndarray, int]] = TENSORS) -> pb.TensorsResponse:
    return pb.TensorsResponse(
        tensors=[
            pb.NamedTensor(name=name, tensor=pb.Tensor(dtype=dtype, shape=array.shape))
            for name, array, dtype in tensors
        ],
        timings=pb.Timings(compute_seconds=0.5),
        model_name="m",
        request_id="r",
    )


def _chunks(cuts: list[int], data: bytes = DATA) -> list[bytes]:
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
    messages = [pb.TensorsChunk(header=_header())]
    messages += [pb.TensorsChunk(data=data[a:b]) for a, b in itertools.pairwise(bounds)]
    return [m.SerializeToString() for m in messages]


def _assemble(parts: list[bytes]) -> dict[str, np.ndarray]:
    assembler = TensorsChunkAssembler()
    for part in parts:
        assembler.add(part)
    tensors, header = assembler.result()
    assert header.request_id == "r" and header.timings.compute_seconds == 0.5
    return tensors


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(DATA)), max_size=8))
def test_any_split_reassembles_every_tensor_exactly(cuts: list[int]) -> None:
    tensors = _assemble(_chunks(cuts))
    assert list(tensors) == ["ids", "scores", "logits"]
    for name, array, _ in TENSORS:
        np.testing.assert_array_equal(tensors[name], array)
        assert tensors[name].dtype == array.dtype and tensors[name].flags.writeable


def test_a_nearest_result_from_chunks() -> None:
    assembler = TensorsChunkAssembler()
    for part in _chunks([5, 96, 97, 200]):
        assembler.add(pb.TensorsChunk.FromString(part))  # parsed messages too
    result = nearest_result_of(*assembler.result())
    np.testing.assert_array_equal(result.ids, IDS)
    np.testing.assert_array_equal(result.scores, SCORES)
    assert result.logits is not None
    np.testing.assert_array_equal(result.logits, LOGITS)
    assert result.request_id == "r" and result.model_name == "m"


def _raw(message: pb.TensorsChunk) -> bytes:
    return message.SerializeToString()


@pytest.mark.parametrize(
    ("parts", "match"),
    [
        ([_raw(pb.TensorsChunk(data=b"x"))], "data before its header"),
        ([], "ended without a header"),
        (_chunks([])[:-1], f"ended after 0 of {len(DATA)} bytes"),
        ([*_chunks([]), _raw(pb.TensorsChunk(data=b"x"))], f"more than the {len(DATA)} bytes"),
        ([*_chunks([])[:1], *_chunks([])[:1]], "a second header"),
        (
            [_raw(pb.TensorsChunk(header=_header([("ids", IDS, pb.DTYPE_INT64)] * 2)))],
            "names tensor 'ids' twice",
        ),
        ([_raw(pb.TensorsChunk(header=_header([("x", IDS, 99)])))], "tensor 'x' of dtype"),
        ([b"\x0a\x05\xff\xff"], "cannot parse TensorsChunk"),
    ],
)
def test_broken_streams(parts: list[bytes], match: str) -> None:
    with pytest.raises(ServerError, match=match):
        assembler = TensorsChunkAssembler()
        for part in parts:
            assembler.add(part)
        assembler.result()
