"""Domain objects of one request's journey: what came in, what goes out.

The servicer translates protobuf into ``EmbedInput`` and ``EmbedOutput`` back into
bytes; everything between works on these and never sees gRPC.

They are made for every request, so they are slotted and not frozen: nothing changes
them after construction, and a frozen dataclass's ``__init__`` (one
``object.__setattr__`` per field) cost ~1 us for nine fields in a hot loop and several
times that in the running server, where a tiny request's whole handler is ~80 us.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

PADDED = "padded"
FLAT = "flat"


@dataclass(slots=True)
class EmbedInput:
    """A request as decoded from the wire, not yet validated."""

    ids_dtype: str  # "int64", "int32", or whatever else was sent (rejected later)
    shape: tuple[int, ...]
    data: bytes
    lengths: tuple[int, ...] = ()
    output_dtype: str = "float32"
    layout: str = PADDED
    model_name: str = ""
    request_id: str = ""


@dataclass(slots=True)
class EmbedJob:
    """A validated request: flat int64 ids in [0, V), and how to shape the answer."""

    ids: np.ndarray  # int64 [N], contiguous
    batch: int  # B
    seq_len: int  # S (rectangular) or S_max (ragged)
    lengths: tuple[int, ...] | None  # ragged input only
    output_dtype: np.dtype
    layout: str
    output_bytes: int
    request_id: str = ""

    @property
    def tokens(self) -> int:
        return int(self.ids.size)

    @property
    def ragged(self) -> bool:
        return self.lengths is not None


@dataclass(slots=True)
class Timings:
    queue_s: float
    compute_s: float
    batch_requests: int
    batch_tokens: int


@dataclass(slots=True)
class EmbedOutput:
    hidden_states: np.ndarray  # [B,S,D] or [N,D], C-contiguous, float32 or float16
    lengths: tuple[int, ...] | None
    timings: Timings


# Where the caller would like an answer written, when it can take one in place (the
# servicer: straight into the response's bytes): given the answer's shape, dtype,
# lengths and timings (compute_s is not known yet and given as 0.0), an empty array
# to fill. The service uses it only where it writes every row itself (see
# EmbeddingService.embed).
AnswerInto = Callable[[tuple[int, ...], np.dtype, "tuple[int, ...] | None", Timings], np.ndarray]
