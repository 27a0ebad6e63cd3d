"""The answers of several named tensors (nearest's, a tokenizer's), framed by hand
(tokembed.v1's ``TensorsResponse`` and ``TensorsChunk``s, V2's ``ModelInferResponse`` and
``ModelStreamInferResponse``), are the bytes protobuf writes for the same messages."""

from __future__ import annotations

import numpy as np
import pytest

from tokembed.server.core.dtypes import FLOAT16, FLOAT32, INT32, INT64
from tokembed.server.core.types import Answer, NamedTensor, Timings
from tokembed.server.edge.v1.responses import (
    chunk_slices,
    tensors_chunk_header,
    tensors_response,
)
from tokembed.server.edge.v2.responses import tensors_infer_response, tensors_stream_response
from tokembed.v1 import embedding_pb2 as pb
from tokembed.v2 import grpc_service_pb2 as v2_pb

_WIRE = {INT64: pb.DTYPE_INT64, INT32: pb.DTYPE_INT32, FLOAT32: pb.DTYPE_FLOAT32,
         FLOAT16: pb.DTYPE_FLOAT16}  # fmt: skip


def _answer(tokens: int, d_model: int, timings: Timings) -> tuple[Answer, list[tuple]]:
    rng = np.random.default_rng(tokens)
    arrays = [
        ("input_ids", rng.integers(0, 1 << 40, tokens).astype(np.int64), INT64),
        ("lengths", np.array([tokens], dtype=np.int64), INT64),
        ("special_tokens_mask", rng.integers(0, 2, tokens).astype(np.int32), INT32),
        ("hidden_states", rng.standard_normal((tokens, d_model)).astype(np.float16), FLOAT16),
    ]
    tensors = []
    for name, array, dtype in arrays:
        data = array.tobytes()
        # The pieces as a look-up gives them: several, views among them.
        view = memoryview(data)
        pieces = [view[: len(data) // 2], bytes(view[len(data) // 2 :])]
        tensors.append(NamedTensor(name, array.shape, dtype, pieces, len(data)))
    return Answer.of_tensors(tensors, timings, tokens, "model", "3"), arrays


@pytest.mark.parametrize("tokens", [0, 1, 7, 300])
@pytest.mark.parametrize("timed", [False, True])
def test_tensors_response_is_protobufs_bytes(tokens: int, timed: bool) -> None:
    timings = Timings(0.25, 1e-3, 3, 1 << 20) if timed else Timings(0.0, 0.0, 0, 0)
    answer, arrays = _answer(tokens, 5, timings)
    expected = pb.TensorsResponse(
        tensors=[
            pb.NamedTensor(name=name, tensor=pb.Tensor(
                dtype=_WIRE[dtype], shape=array.shape, data=array.tobytes()))
            for name, array, dtype in arrays
        ],
        timings=pb.Timings(queue_seconds=timings.queue_s, compute_seconds=timings.compute_s,
                           server_seconds=0.5, batch_requests=timings.batch_requests,
                           batch_tokens=timings.batch_tokens),
        model_name="model", model_version="3", request_id="r-1" if timed else "",
    )  # fmt: skip
    framed = tensors_response(answer, "r-1" if timed else "", 0.5)
    assert framed == expected.SerializeToString()
    assert pb.TensorsResponse.FromString(framed) == expected


@pytest.mark.parametrize("tokens", [0, 1, 300])
def test_model_infer_response_is_protobufs_bytes(tokens: int) -> None:
    answer, arrays = _answer(tokens, 4, Timings(0.0, 0.0, 1, tokens))
    expected = v2_pb.ModelInferResponse(
        model_name="model", model_version="3", id="abc",
        outputs=[
            v2_pb.ModelInferResponse.InferOutputTensor(
                name=name, datatype=dtype.v2, shape=array.shape)
            for name, array, dtype in arrays
        ],
        raw_output_contents=[array.tobytes() for _, array, _ in arrays],
    )  # fmt: skip
    assert tensors_infer_response(answer, "abc") == expected.SerializeToString()


@pytest.mark.parametrize("tokens", [0, 1, 7, 300])
@pytest.mark.parametrize("chunk_bytes", [1, 7, 1000, 1 << 20])
def test_tensors_chunks_are_protobufs_bytes(tokens: int, chunk_bytes: int) -> None:
    timings = Timings(0.25, 1e-3, 3, 1 << 20)
    answer, arrays = _answer(tokens, 5, timings)
    expected_header = pb.TensorsResponse(
        tensors=[
            pb.NamedTensor(name=name, tensor=pb.Tensor(dtype=_WIRE[dtype], shape=array.shape))
            for name, array, dtype in arrays
        ],
        timings=pb.Timings(queue_seconds=0.25, compute_seconds=1e-3, server_seconds=0.5,
                           batch_requests=3, batch_tokens=1 << 20),
        model_name="model", model_version="3", request_id="r-2",
    )  # fmt: skip
    header = tensors_chunk_header(answer, "r-2", 0.5)
    assert header == pb.TensorsChunk(header=expected_header).SerializeToString()
    pieces = [piece for tensor in answer.tensors for piece in tensor.pieces]
    slices = list(chunk_slices(pieces, chunk_bytes))
    data = b"".join(array.tobytes() for _, array, _ in arrays)
    expected = [data[at : at + chunk_bytes] for at in range(0, len(data), chunk_bytes)]
    assert slices == [pb.TensorsChunk(data=part).SerializeToString() for part in expected]


@pytest.mark.parametrize("tokens", [0, 1, 300])
def test_model_stream_infer_response_is_protobufs_bytes(tokens: int) -> None:
    answer, arrays = _answer(tokens, 4, Timings(0.0, 0.0, 1, tokens))
    expected = v2_pb.ModelInferResponse(
        model_name="model", model_version="3", id="s",
        outputs=[
            v2_pb.ModelInferResponse.InferOutputTensor(
                name=name, datatype=dtype.v2, shape=array.shape)
            for name, array, dtype in arrays
        ],
        raw_output_contents=[array.tobytes() for _, array, _ in arrays],
    )  # fmt: skip
    framed = tensors_stream_response(answer, "s")
    assert framed == v2_pb.ModelStreamInferResponse(infer_response=expected).SerializeToString()
