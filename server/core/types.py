"""The domain objects of one request's journey: what came in, what was validated, what
goes out. Protocols translate their messages into ``EmbedInput`` and encode an ``Answer``;
everything between works on these and never sees a transport.

They are made for every request, so they are slotted and not frozen: nothing changes
them after construction, and a frozen dataclass's ``__init__`` (one
``object.__setattr__`` per field) costs ~1 us for nine fields in a hot loop and several
times that in the running server, where a tiny request's whole handler is ~60 us.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PADDED = "padded"
FLAT = "flat"

# What answers are made of: pieces of bytes that, joined in order, are a tensor's bytes.
Buffer = bytes | memoryview

# The dtypes an answer may be asked for, by name. float32 is what a model computes; each
# other one is its rows cast (backends.sessions.output_casts), once per table or answer.
FLOAT32 = np.dtype("<f4")
OUTPUT_DTYPES: dict[str, np.dtype] = {"float32": FLOAT32, "float16": np.dtype("<f2")}

_INT64 = np.dtype("<i8")
_LITTLE_ENDIAN = sys.byteorder == "little"


@dataclass(slots=True)
class EmbedInput:
    """A request as decoded from the wire, not yet validated."""

    ids_dtype: str  # "int64", "int32", or whatever else was sent (refused by validation)
    shape: tuple[int, ...]
    data: bytes
    lengths: tuple[int, ...] = ()
    output_dtype: str = "float32"
    layout: str = PADDED


class TokenIds:
    """Validated ids, kept as the wire's little-endian bytes and read, once each, as the
    form a look-up wants: Python ints (a table's rows are sliced by them, no numpy call
    per request) or an int64 array (onnxruntime's input)."""

    __slots__ = ("_array", "_data", "_dtype", "_values", "count")

    def __init__(self, data: bytes, dtype: np.dtype, count: int) -> None:
        self._data = data
        self._dtype = dtype  # "<i8" or "<i4"
        self.count = count
        self._values: list[int] | None = None
        self._array: np.ndarray | None = None

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
            ids = np.frombuffer(self._data, dtype=self._dtype)
            self._array = ids if self._dtype == _INT64 else ids.astype(np.int64)
        return self._array


@dataclass(slots=True)
class Job:
    """A validated request: ids in [0, V), how to shape the answer, and its size."""

    ids: TokenIds
    batch: int  # B
    seq_len: int  # S (rectangular) or S_max (ragged)
    lengths: tuple[int, ...] | None  # ragged input only
    output_dtype: np.dtype
    layout: str
    output_bytes: int

    @property
    def tokens(self) -> int:
        return self.ids.count

    @property
    def ragged(self) -> bool:
        return self.lengths is not None

    @property
    def padded(self) -> bool:
        """Ragged input answered [B, S_max, D]: rows of padding after each sequence."""
        return self.lengths is not None and self.layout == PADDED

    def answer_shape(self, d_model: int) -> tuple[int, ...]:
        if self.lengths is not None and self.layout == FLAT:
            return (self.tokens, d_model)
        return (self.batch, self.seq_len, d_model)


@dataclass(slots=True)
class Timings:
    queue_s: float  # waiting for a batch (0 when the look-up did not queue)
    compute_s: float  # the look-up of the batch this request was part of
    batch_requests: int
    batch_tokens: int


@dataclass(slots=True)
class Answer:
    """One request's answer: a ``shape`` tensor of ``dtype`` whose C-order bytes are
    ``pieces`` joined in order. The pieces are views of what the look-up produced (a
    table's rows, or the rows of an onnxruntime run): whoever writes them into a
    response copies each byte once."""

    shape: tuple[int, ...]
    dtype: np.dtype
    pieces: Sequence[Buffer]
    lengths: tuple[int, ...] | None
    timings: Timings
    tokens: int
    nbytes: int
