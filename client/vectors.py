"""Encoding a nearest request: vectors ``[N, D]`` or ``[B, S, D]`` of float32, float16 or
bfloat16 (an ``ml_dtypes.bfloat16`` array), sent in their own dtype (the server widens
them to float32 exactly); anything else array-like is sent as float32."""

from __future__ import annotations

from typing import Any

import numpy as np

from tokembed.client import dtypes
from tokembed.client.errors import client_invalid_input
from tokembed.v1 import embedding_pb2 as pb

METRICS = {"dot": pb.METRIC_DOT, "cosine": pb.METRIC_COSINE}


def nearest_request(
    vectors: Any,
    k: int,
    metric: str,
    logits: bool,
    apply_norm: bool,
    model_name: str,
    request_id: str,
) -> pb.NearestRequest:
    """The request, or ``InvalidInputError`` (before anything is sent) for vectors that
    are not 2-D or 3-D floats, or a metric or k that cannot be right."""
    if metric not in METRICS:
        raise client_invalid_input(f"metric {metric!r} is not one of {sorted(METRICS)}")
    # k = 0 and k past the limit are the server's to refuse (it knows V and its limit);
    # what the wire cannot carry is refused here.
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < 2**32:
        raise client_invalid_input(f"k must be an integer in [1, 2**32), got {k!r}")
    try:
        array = np.asarray(vectors)
    except (TypeError, ValueError) as exc:
        raise client_invalid_input(f"vectors cannot be read as an array: {exc}") from exc
    by_name = {row.numpy: row for row in dtypes.OUTPUT.values()}
    row = by_name.get(array.dtype)
    if row is None:
        if array.dtype.kind not in "fiu":
            raise client_invalid_input(f"vectors of dtype {array.dtype} are not numbers")
        array, row = array.astype(np.float32), dtypes.FLOAT32
    if array.ndim not in (2, 3):
        raise client_invalid_input(f"vectors shape {list(array.shape)} must be [N, D] or [B, S, D]")
    return pb.NearestRequest(
        vectors=pb.Tensor(dtype=row.wire, shape=list(array.shape), data=array.tobytes()),
        k=k,
        metric=METRICS[metric],
        logits=logits,
        apply_norm=apply_norm,
        model_name=model_name,
        request_id=request_id,
    )
