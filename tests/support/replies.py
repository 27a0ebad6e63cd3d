"""EmbedResponse messages as a server sends them, for tests of the client's decoding."""

from __future__ import annotations

from typing import Any

import numpy as np

from tokembed.v1 import embedding_pb2 as pb


def response(hs: np.ndarray, **kwargs: Any) -> pb.EmbedResponse:
    """An answer holding ``hs`` (float32 or float16), with timings, names and a request id;
    ``kwargs`` sets further fields (``lengths=...``)."""
    wire = pb.DTYPE_FLOAT16 if hs.dtype == np.float16 else pb.DTYPE_FLOAT32
    return pb.EmbedResponse(
        hidden_states=pb.Tensor(dtype=wire, shape=hs.shape, data=hs.tobytes()),
        timings=pb.Timings(queue_seconds=0.5, compute_seconds=0.25, batch_requests=3),
        model_name="m",
        model_version="2",
        request_id="rid",
        **kwargs,
    )
