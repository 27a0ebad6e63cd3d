"""The client's decoding of answers of several named tensors: a large answer's tensors are
views of the received bytes, equal to what protobuf's own parse gives."""

from __future__ import annotations

import numpy as np
import pytest

from tokembed.client import text_codec
from tokembed.client.decode import ZERO_COPY_MIN_BYTES
from tokembed.v1 import embedding_pb2 as pb


def _response(tokens: int, d_model: int) -> tuple[pb.TensorsResponse, dict[str, np.ndarray]]:
    rng = np.random.default_rng(tokens)
    arrays = {
        "input_ids": rng.integers(0, 1 << 40, tokens).astype(np.int64),
        "lengths": np.array([tokens // 2, tokens - tokens // 2], dtype=np.int64),
        "hidden_states": rng.standard_normal((tokens, d_model)).astype(np.float32),
    }
    codes = {np.dtype(np.int64): pb.DTYPE_INT64, np.dtype(np.float32): pb.DTYPE_FLOAT32}
    response = pb.TensorsResponse(
        tensors=[
            pb.NamedTensor(name=name, tensor=pb.Tensor(
                dtype=codes[a.dtype], shape=a.shape, data=a.tobytes()))
            for name, a in arrays.items()
        ],
        timings=pb.Timings(compute_seconds=0.5, batch_tokens=tokens),
        model_name="m", model_version="2", request_id="r",
    )  # fmt: skip
    return response, arrays


@pytest.mark.parametrize(("tokens", "in_place"), [(10, False), (2000, True)])
def test_named_tensors_equal_protobufs_parse(tokens: int, in_place: bool) -> None:
    response, arrays = _response(tokens, 64)
    raw = response.SerializeToString()
    assert (len(raw) >= ZERO_COPY_MIN_BYTES) == in_place
    result = text_codec.embed_text_result(raw)
    for name in arrays:
        np.testing.assert_array_equal(getattr(result, name), arrays[name])
    assert (result.timings.compute_seconds, result.timings.batch_tokens) == (0.5, tokens)
    assert (result.model_name, result.model_version, result.request_id) == ("m", "2", "r")
    # A large answer's rows are a view of the received bytes: no copy.
    assert np.shares_memory(result.hidden_states, np.frombuffer(raw, np.uint8)) == in_place
    assert [len(s) for s in result.sequences()] == arrays["lengths"].tolist()
