"""The backend interface: how one model's ids become rows.

A backend is chosen for a model at load (``tokembed.server.models.loading``) and reported in
GetModelInfo and the logs. The scheduler asks it for the rows of one request, or of a
batch of requests when the backend gains from company (``batches``); it never asks how.

A request's ids arrive as a ``LookUp``: the primary ids, the answer's dtype, and the
model kind's further id inputs by name (none for a ``token`` model). Rows come back as
``Rows``: pieces of bytes in the order of the ids (bytes, or flat byte views: each
piece's ``len`` is its size in bytes), which the answer is made of without another copy
(see ``types.Answer``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import numpy as np

from tokembed.server.backends.head import NearestHead
from tokembed.server.core.dtypes import DType
from tokembed.server.core.types import Buffer, TokenIds


class LookUp:
    """One request's look-up: its ids (already in range), the dtype of its answer, and
    the kind's other id inputs by name (an optional one the request did not send is
    absent, and computed as 0s)."""

    __slots__ = ("dtype", "ids", "more")

    def __init__(
        self, ids: TokenIds, dtype: DType, more: Mapping[str, TokenIds] | None = None
    ) -> None:
        self.ids = ids
        self.dtype = dtype
        self.more: Mapping[str, TokenIds] = more or {}


class Rows(ABC):
    """The rows of some ids, in their order."""

    @abstractmethod
    def pieces(self, start: int, stop: int) -> Sequence[Buffer]:
        """The bytes of rows ``[start, stop)``, as pieces to join in order."""

    @abstractmethod
    def __len__(self) -> int:
        """How many rows."""

    def joined(self) -> Buffer:
        """Every row's bytes in one buffer (no copy where they are one piece already):
        the least any writer of the answer does (the bench's ceiling measures it)."""
        pieces = self.pieces(0, len(self))
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


class ArrayRows(Rows):
    """Rows held in one C-contiguous ``[n, D]`` array (an onnxruntime run's output)."""

    __slots__ = ("_bytes", "_row_bytes", "_rows")

    def __init__(self, array: np.ndarray) -> None:
        if array.ndim != 2 or not array.flags.c_contiguous:
            raise ValueError(f"this is a bug: rows must be a C-contiguous [n, D] array, got "
                             f"shape {array.shape}")  # fmt: skip
        self._rows = len(array)
        self._row_bytes = array.shape[1] * array.itemsize
        self._bytes = byte_view(array)

    def pieces(self, start: int, stop: int) -> list[Buffer]:
        size = self._row_bytes
        return [self._bytes[start * size : stop * size]]

    def __len__(self) -> int:
        return self._rows


def byte_view(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, as a flat memoryview of it (no copy). A
    bfloat16 one (numpy kind "V": ml_dtypes') through a uint8 view of it, since the buffer
    protocol knows no bfloat16."""
    if not array.size:
        return memoryview(b"")
    return (array.view(np.uint8) if array.dtype.kind == "V" else array).data.cast("B")


class Backend(ABC):
    """One model's look-ups. Implementations are thread-safe: the scheduler calls them on
    the event loop or on worker threads, several at once."""

    kind: str  # "table" or "onnxruntime": what GetModelInfo reports
    execution_provider: str  # the onnxruntime provider that computed (or computes) the rows
    d_model: int
    # True when one look-up of many requests' ids costs less than one each (an
    # onnxruntime run has a fixed cost per call, and on CUDA a kernel launch): the
    # scheduler then batches. A gather from memory gains nothing from company.
    batches: bool = False
    # What each way of serving this model would hold in memory, by backend kind ("table",
    # "onnxruntime"): set by the loader, which chose among them (GetModelInfo shows it).
    serving_memory: dict[str, int] = {}  # noqa: RUF012 - replaced per instance, never changed
    # The way back from vectors to ids (``nearest``), set by the loader for a model whose
    # manifest records a head; None: the model answers no nearest.
    head: NearestHead | None = None

    @abstractmethod
    def look_up(self, request: LookUp) -> Rows:
        """The rows of one request's ids in its dtype (one of ``dtypes.OUTPUT_DTYPES``)."""

    def look_up_batch(self, requests: Sequence[LookUp]) -> list[Rows]:
        """The rows of several requests, one ``Rows`` each, in order. By default one
        look-up each; a backend that ``batches`` does them in one go."""
        return [self.look_up(request) for request in requests]

    @abstractmethod
    def pad_row(self, dtype: DType) -> bytes:
        """What padded positions of ragged answers hold, as one row of ``dtype``: the
        padding id's row as the model computes it, zeros when it has no padding id."""

    @property
    def memory_bytes(self) -> dict[str, int]:
        """What the backend holds in memory, by what it is (GetModelInfo, the load log)."""
        return {}

    def held_table(self, dtype_name: str) -> np.ndarray | None:
        """The ``[V, D]`` rows the backend holds in dtype ``dtype_name``, if any:
        the head reads them instead of a table of its own when their bytes are the
        head's (``models.loading``)."""
        return None

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to let go of
        """Let go of what the backend holds (the model is unloaded)."""
