"""The wire contract with plain generated stubs: any protobuf/gRPC client can call us."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tokembed.v1 import embedding_pb2 as pb

from support.requests import embed_request, stub_for


def test_design_example_with_generated_stubs(
    default_model_dir: Path, start_server: Any, default_rows: np.ndarray
) -> None:
    server = start_server(default_model_dir)
    ids = np.array([[5, 6, 7, 8, 9, 10, 11, 12]], dtype=np.int64)
    with stub_for(server.target) as stub:
        reply = stub.Embed(embed_request(ids), timeout=10)
    assert list(reply.hidden_states.shape) == [1, 8, 512]
    assert reply.hidden_states.dtype == pb.DTYPE_FLOAT32
    got = np.frombuffer(reply.hidden_states.data, dtype="<f4").reshape(1, 8, 512)
    want = default_rows[ids]
    np.testing.assert_array_equal(got, want)
    assert reply.model_name == "tokembed-default"
    assert reply.timings.batch_tokens >= 8
