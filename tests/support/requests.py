"""tokembed.v1 requests built by hand, as any gRPC client builds them, for tests that talk
to the server through the plain generated stubs (or send raw bytes on a method's path),
so that what they check is what arrives on the wire, independent of our client library.

    embed_request([[1, 2, 3]])                   # int64 ids, shape [1, 3]
    embed_request(ids.astype("<i4"), output_dtype=pb.DTYPE_FLOAT16, model_name="small")
    embed_request(flat, lengths=[3, 5], layout=pb.RAGGED_LAYOUT_FLAT)
    encode(...)                                  # the same, as wire bytes

Any field may be given a value that is wrong (a dtype the bytes do not match, a shape they
do not fill), for the tests of refusals.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import grpc
import numpy as np

from tokembed.v1 import embedding_pb2 as pb
from tokembed.v1 import embedding_pb2_grpc

REASON_KEY = "tokembed-error-reason"  # the trailer naming why a call was refused
_WIRE = {np.dtype("<i8"): pb.DTYPE_INT64, np.dtype("<i4"): pb.DTYPE_INT32}


def embed_request(
    ids: Any = None,
    *,
    ids_dtype: int | None = None,
    shape: Sequence[int] | None = None,
    data: bytes | None = None,
    lengths: Sequence[int] = (),
    output_dtype: int = pb.DTYPE_UNSPECIFIED,
    layout: int = pb.RAGGED_LAYOUT_UNSPECIFIED,
    model_name: str = "",
    model_version: str = "",
    request_id: str = "",
    order: int = pb.LAYOUT_UNSPECIFIED,
) -> pb.EmbedRequest:
    """An ``EmbedRequest`` for ``ids`` ([B, S], or [N] with ``lengths``: a list, or an
    array sent as its bytes are).

    ``ids_dtype``: the dtype the tensor declares; by default int32 for an int32 array and
    int64 for an int64 one (a list's ids are int64); another array must name one.
    ``shape`` and ``data`` replace the array's. Without ``ids``, ``shape`` or ``data`` the
    request has no ``input_ids`` at all. ``layout`` is the ragged layout; ``order`` the
    Layout field (batch- or sequence-first).
    """
    request = pb.EmbedRequest(
        lengths=list(lengths),
        output_dtype=output_dtype,  # type: ignore[arg-type]
        ragged_layout=layout,  # type: ignore[arg-type]
        model_name=model_name,
        model_version=model_version,
        request_id=request_id,
        layout=order,  # type: ignore[arg-type]
    )
    if ids is None and shape is None and data is None:
        return request
    array = np.empty(0, "<i8") if ids is None else np.asarray(ids)
    if ids_dtype is None:
        assert array.dtype in _WIRE, f"say which dtype {array.dtype} ids are sent as"
        ids_dtype = _WIRE[array.dtype]
    request.input_ids.dtype = ids_dtype  # type: ignore[assignment]
    request.input_ids.shape.extend(list(array.shape if shape is None else shape))
    request.input_ids.data = array.tobytes() if data is None else data
    return request


def encode(ids: Any = None, **fields: Any) -> bytes:
    """:func:`embed_request` as wire bytes (``channel.unary_unary(path)`` sends them as
    they are)."""
    return embed_request(ids, **fields).SerializeToString()


def ids_of(n_tokens: int, start: int = 1, batch: int = 1) -> np.ndarray:
    """Valid ids of the small model (V=1000), ``[batch, n_tokens]``, int64, counting up
    from ``start``."""
    return (np.arange(batch * n_tokens, dtype=np.int64) + start).reshape(batch, n_tokens) % 1000


@contextmanager
def stub_for(
    target: str, options: Sequence[tuple[str, Any]] = ()
) -> Iterator[embedding_pb2_grpc.EmbeddingServiceStub]:
    """The plain generated stub on an insecure channel to ``target`` (with the channel
    ``options`` given, such as a larger message limit)."""
    with grpc.insecure_channel(target, options=list(options)) as channel:
        yield embedding_pb2_grpc.EmbeddingServiceStub(channel)


def reason_of(error: grpc.RpcError) -> str | None:
    """The ``tokembed-error-reason`` trailer of a failed call (why, beyond the status
    code); None when it has none."""
    call: Any = error
    for key, value in call.trailing_metadata() or ():
        if key == REASON_KEY:
            return str(value)
    return None
