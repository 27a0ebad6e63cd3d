"""What every operation's answer is made of, and the ids look-ups read.

Front ends translate their messages into an operation's request (``operations``) and
frame an ``Answer`` (their sink, ``dataplane.Sink``); everything between works on these
and never sees a transport.

They are made for every request, so they are slotted and not frozen: nothing changes
them after construction, and a frozen dataclass's ``__init__`` (one
``object.__setattr__`` per field) is a measurable part of a tiny request's handler.
"""

from __future__ import annotations

import sys
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokembed.server.core.dtypes import INT64, DType

# What answers are made of: pieces of bytes that, joined in order, are a tensor's bytes;
# each is bytes or a flat view of unsigned bytes, so that its ``len`` is its size in bytes.
Buffer = bytes | memoryview

_LITTLE_ENDIAN = sys.byteorder == "little"


class GatherableRows(Sequence[Buffer]):
    """An answer's pieces that are rows picked from one table (a look-up's row views),
    each ``row_bytes`` long, which can also be had gathered: ``gather(start, into)``
    copies rows from ``start`` on, as many as fit ``into`` (a writable buffer) and there
    are, to its start, and gives the part of it they fill. A writer that copies an answer
    into a file (a shared-memory region) writes runs of these: numpy's gather into a
    buffer small enough to stay in the cache, then the kernel's copy from there, beat the
    kernel's copy of each row from where it lies in the table (docs/benchmarks/README.md,
    "Shared memory"). Runs are independent of each other, so two threads may gather and
    write different runs at once, each into a buffer of its own."""

    __slots__ = ()

    @property
    @abstractmethod
    def row_bytes(self) -> int: ...

    @abstractmethod
    def gather(self, start: int, into: memoryview) -> memoryview: ...


class TokenIds:
    """Validated ids, kept as the wire's little-endian bytes and read, once each, as the
    form a look-up wants: Python ints (a table's rows are sliced by them, no numpy call
    per request) or an int64 array (onnxruntime's input)."""

    __slots__ = ("_array", "_data", "_dtype", "_values", "count")

    def __init__(self, data: bytes, dtype: DType, count: int) -> None:
        self._data = data
        self._dtype = dtype  # int64 or int32
        self.count = count
        self._values: list[int] | None = None
        self._array: np.ndarray | None = None

    @classmethod
    def of(cls, ids: Sequence[int]) -> TokenIds:
        """Ids from Python ints (for the server's own look-ups: padding rows, warm-up)."""
        return cls(np.asarray(ids, dtype=INT64.numpy).tobytes(), INT64, len(ids))

    def values(self) -> list[int]:
        if self._values is None:
            if _LITTLE_ENDIAN:
                data = memoryview(self._data)
                view = data.cast("q") if self._dtype.itemsize == 8 else data.cast("i")
                self._values = view.tolist()
            else:  # pragma: no cover - no big-endian machine here
                self._values = self.array().tolist()
        return self._values

    def array(self) -> np.ndarray:
        """int64 ``[count]``; read-only when it is a view of the request's bytes."""
        if self._array is None:
            ids = np.frombuffer(self._data, dtype=self._dtype.numpy)
            self._array = ids if self._dtype == INT64 else ids.astype(INT64.numpy)
        return self._array


@dataclass(slots=True)
class Timings:
    queue_s: float  # waiting for a batch (0 when the request did not queue)
    compute_s: float  # the compute of the batch this request was part of
    batch_requests: int
    batch_tokens: int


@dataclass(slots=True)
class NamedTensor:
    """One of an answer's several tensors: its name on the wire (``ids``, ``scores``,
    ``logits``; a tokenizer's ``offsets``), and its C-order bytes as pieces."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    pieces: Sequence[Buffer]
    nbytes: int  # the pieces' bytes together (a look-up's rows are many pieces)


@dataclass(slots=True)
class Answer:
    """One request's answer: a ``shape`` tensor of ``dtype`` whose C-order bytes are
    ``pieces`` joined in order. The pieces are views of what the compute produced (a
    table's rows, or the rows of an onnxruntime run): whoever frames them into a
    response copies each byte once.

    An answer of several named tensors (``nearest``'s ids, scores and logits) lists them
    in ``tensors``, in the order they are framed; its ``shape``, ``dtype`` and ``pieces``
    are then the first one's (what the metrics and the log describe). Every front end
    frames ``tensors`` the same way whatever the operation (``several``), so that a new
    operation of several outputs needs no framing code of its own.
    """

    shape: tuple[int, ...]
    dtype: DType
    pieces: Sequence[Buffer]
    lengths: tuple[int, ...] | None  # ragged requests' lengths, echoed
    timings: Timings
    tokens: int
    nbytes: int
    model_name: str
    model_version: str
    tensors: Sequence[NamedTensor] = ()

    @property
    def several(self) -> bool:
        """Whether the answer is ``tensors`` (named) rather than one unnamed tensor."""
        return bool(self.tensors)

    @classmethod
    def of_tensors(
        cls,
        tensors: Sequence[NamedTensor],
        timings: Timings,
        tokens: int,
        model_name: str,
        model_version: str,
    ) -> Answer:
        """An answer of several named tensors, described by its first (``several``)."""
        first = tensors[0]
        return cls(
            first.shape, first.dtype, first.pieces, None, timings, tokens,
            sum(tensor.nbytes for tensor in tensors), model_name, model_version, tuple(tensors),
        )  # fmt: skip
