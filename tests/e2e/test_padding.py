"""Ragged input padded with the padding id's row, end to end, on a model whose padding id
is 7 and whose row 7 is neither zeros nor row 0 (``pad_model_dir``): the small model's
padding id is 0 and its row zeros, so a pad taken from row 0, or zeros, passes there.

Both protocols (tokembed.v1's Embed, EmbedStream and sequence-first answers; the Open
Inference Protocol's ModelInfer through tritonclient and ModelStreamInfer), on both
backends, in float32 and float16.
"""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as tc

from tokembed.v1 import embedding_pb2 as pb

from support.fixtures import EVERY_BACKEND, PAD_D, PAD_ID, PAD_V
from support.models import padded
from support.requests import embed_request, stub_for

TIMEOUT_S = 30
# Three sequences of different lengths: the first is the longest, the others are padded.
SEQS = [[1, 2, 3, 4], [5], [PAD_V - 1, 0]]
LENGTHS = [len(seq) for seq in SEQS]
FLAT = np.array([i for seq in SEQS for i in seq], dtype=np.int64)
WIRE = {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16}
V2_DTYPES = {"float32": "FP32", "float16": "FP16"}


def expected(rows: np.ndarray, dtype: str) -> np.ndarray:
    return padded(rows, SEQS, rows[PAD_ID]).astype(dtype)


def v1_array(tensor: pb.Tensor, dtype: str) -> np.ndarray:
    assert tensor.dtype == WIRE[dtype]
    return np.frombuffer(tensor.data, dtype=dtype).reshape(list(tensor.shape))


def ragged_v2_inputs() -> list[tc.InferInput]:
    ids = tc.InferInput("input_ids", [FLAT.size], "INT64")
    ids.set_data_from_numpy(FLAT)
    lengths = tc.InferInput("lengths", [len(LENGTHS)], "INT64")
    lengths.set_data_from_numpy(np.array(LENGTHS, dtype=np.int64))
    return [ids, lengths]


@EVERY_BACKEND
def test_tokembed_v1_pads_with_the_padding_id_s_row(
    pad_model_dir: Path, start_server: Any, pad_rows: np.ndarray, backend: Any
) -> None:
    server = start_server(pad_model_dir, **backend)
    with stub_for(server.target) as stub:
        for dtype in WIRE:
            want = expected(pad_rows, dtype)
            request = embed_request(FLAT, lengths=LENGTHS, output_dtype=WIRE[dtype])
            reply = stub.Embed(request, timeout=TIMEOUT_S)
            np.testing.assert_array_equal(v1_array(reply.hidden_states, dtype), want)

            answers = list(stub.EmbedStream(iter([request, request]), timeout=TIMEOUT_S))
            assert [a.WhichOneof("result") for a in answers] == ["response", "response"]
            for answer in answers:
                got = v1_array(answer.response.hidden_states, dtype)
                np.testing.assert_array_equal(got, want)

            # Sequence-first: [S_max, B, D], padded position by position.
            first = embed_request(
                FLAT, lengths=LENGTHS, output_dtype=WIRE[dtype], order=pb.LAYOUT_SEQUENCE_FIRST
            )
            reply = stub.Embed(first, timeout=TIMEOUT_S)
            got = v1_array(reply.hidden_states, dtype)
            np.testing.assert_array_equal(got, want.transpose(1, 0, 2))


@EVERY_BACKEND
def test_v2_pads_with_the_padding_id_s_row(
    pad_model_dir: Path, start_server: Any, pad_rows: np.ndarray, backend: Any
) -> None:
    server = start_server(pad_model_dir, **backend)
    answers: queue.Queue[Any] = queue.Queue()
    with tc.InferenceServerClient(server.target) as client:
        for dtype, v2 in V2_DTYPES.items():
            want = expected(pad_rows, dtype)
            result = client.infer("padded", ragged_v2_inputs(), parameters={"datatype": v2})
            got = result.as_numpy("hidden_states")
            assert got.shape == (len(SEQS), max(LENGTHS), PAD_D)
            np.testing.assert_array_equal(got, want)

        client.start_stream(lambda result, error: answers.put(error or result))
        try:
            for v2 in V2_DTYPES.values():
                client.async_stream_infer("padded", ragged_v2_inputs(), parameters={"datatype": v2})
            for dtype in V2_DTYPES:
                streamed = answers.get(timeout=TIMEOUT_S)
                assert isinstance(streamed, tc.InferResult), streamed
                np.testing.assert_array_equal(
                    streamed.as_numpy("hidden_states"), expected(pad_rows, dtype)
                )
        finally:
            client.stop_stream()
