"""The Open Inference Protocol's answers, framed by hand (server/edge/v2/responses.py), are
byte for byte what protobuf serialises for the same ``ModelInferResponse`` and
``ModelStreamInferResponse``, and parse back field for field."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokembed.server.core.dtypes import OUTPUT_DTYPES, DType
from tokembed.server.core.types import Answer, Timings
from tokembed.server.edge.v2 import responses
from tokembed.v2 import grpc_service_pb2 as pb


def answer(shape: tuple[int, ...], dtype: DType, model: str, version: str) -> Answer:
    rows = np.arange(int(np.prod(shape)), dtype=dtype.numpy).reshape(shape)
    # Pieces as the core hands them: views of rows, one per leading index.
    pieces = [memoryview(row.tobytes()) for row in rows.reshape(shape[0], -1)]
    return Answer(
        shape, dtype, pieces, None, Timings(0.0, 0.0, 1, rows.size), rows.size, rows.nbytes,
        model, version,
    )  # fmt: skip


def protobuf_s(answer: Answer, request_id: str) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(
        model_name=answer.model_name, model_version=answer.model_version, id=request_id
    )
    response.outputs.add(name="hidden_states", datatype=answer.dtype.v2, shape=answer.shape)
    response.raw_output_contents.append(b"".join(bytes(p) for p in answer.pieces))
    return response


shapes = st.tuples(
    st.integers(1, 3), st.integers(1, 200), st.sampled_from([1, 8, 64, 300])
)  # fmt: skip


@given(
    shape=shapes,
    dtype=st.sampled_from(list(OUTPUT_DTYPES.values())),
    model=st.sampled_from(["small", "m" * 200, "ünï"]),
    version=st.sampled_from(["", "1", "20260101"]),
    request_id=st.sampled_from(["", "r", "id-" * 50]),
)
def test_infer_response_is_protobuf_s_bytes(
    shape: tuple[int, ...], dtype: DType, model: str, version: str, request_id: str
) -> None:
    framed = answer(shape, dtype, model, version)
    expected = protobuf_s(framed, request_id)
    got = responses.infer_response(framed, "hidden_states", request_id)
    assert got == expected.SerializeToString()
    parsed = pb.ModelInferResponse.FromString(got)
    assert parsed == expected
    values = np.frombuffer(parsed.raw_output_contents[0], dtype.numpy).reshape(shape)
    np.testing.assert_array_equal(values, np.arange(values.size, dtype=dtype.numpy).reshape(shape))


@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 70, 64), (4, 512, 512)])
def test_stream_response_wraps_the_answer_as_protobuf_does(shape: tuple[int, ...]) -> None:
    framed = answer(shape, OUTPUT_DTYPES["float16"], "small", "1")
    expected = pb.ModelStreamInferResponse(infer_response=protobuf_s(framed, "s1"))
    got = responses.stream_response(framed, "hidden_states", "s1")
    assert got == expected.SerializeToString()
    assert pb.ModelStreamInferResponse.FromString(got).error_message == ""


def test_stream_error_carries_the_message_alone() -> None:
    parsed = pb.ModelStreamInferResponse.FromString(responses.stream_error("bad id"))
    assert parsed.error_message == "bad id"
    assert not parsed.HasField("infer_response")
