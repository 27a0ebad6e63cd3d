"""The onnxruntime backend: the model runs for every look-up, one run per batch.

Chosen where the table does not fit its memory limit, and on CUDA (where a run is a
kernel launch, so requests batch). Answers in another dtype than float32 are the float32
rows cast on the CPU with onnxruntime's own Cast (the same rounding as the table
backend's tables of those dtypes).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from tokembed.server.backends.base import ArrayRows, Backend, LookUp, Rows
from tokembed.server.backends.sessions import Cast, ModelSession
from tokembed.server.core.dtypes import FLOAT32, OUTPUT_DTYPES, DType


class OnnxRuntimeBackend(Backend):
    kind = "onnxruntime"
    batches = True

    def __init__(
        self,
        session: ModelSession,
        *,
        padding_id: int | None,
        casts: dict[DType, Cast],
        memory: dict[str, int] | None = None,
    ) -> None:
        """``memory``: what the session holds, by what it is (GetModelInfo, the load log)."""
        self._session = session
        self._memory = dict(memory or {})
        self._casts = casts
        self.d_model = session.d_model
        self.execution_provider = session.provider
        pad = (
            np.zeros((1, self.d_model), dtype=np.float32)
            if padding_id is None
            else session.run(np.array([padding_id], dtype=np.int64))
        )
        self._pad_rows = {
            dtype: self._in_dtype(pad, dtype).tobytes() for dtype in OUTPUT_DTYPES.values()
        }

    @property
    def memory_bytes(self) -> dict[str, int]:
        return self._memory

    def look_up(self, request: LookUp) -> Rows:
        more = {name: ids.array() for name, ids in request.more.items()}
        rows = self._session.run(request.ids.array(), more)
        return ArrayRows(self._in_dtype(rows, request.dtype))

    def look_up_batch(self, requests: Sequence[LookUp]) -> list[Rows]:
        """One run for every request's ids (and the kind's further ids, joined alike),
        the rows sliced back per request."""
        if len(requests) == 1:
            return [self.look_up(requests[0])]
        # An optional input a request did not send is 0s (as ModelSession.run makes it).
        names = {name for request in requests for name in request.more}
        more = {
            name: np.concatenate([
                request.more[name].array() if name in request.more
                else np.zeros(request.ids.count, dtype=np.int64)
                for request in requests
            ])
            for name in names
        }  # fmt: skip
        rows = self._session.run(
            np.concatenate([request.ids.array() for request in requests]), more
        )
        answers: list[Rows] = []
        offset = 0
        for request in requests:
            count, dtype = request.ids.count, request.dtype
            mine = rows[offset : offset + count]
            offset += count
            # Each answer owns its rows: a view would keep the whole batch's rows alive
            # for as long as its slowest reader takes, while admission counts only this
            # answer's bytes.
            answers.append(
                ArrayRows(mine.copy() if dtype == FLOAT32 else self._in_dtype(mine, dtype))
            )
        return answers

    def pad_row(self, dtype: DType) -> bytes:
        return self._pad_rows[dtype]

    def warm_up(self, batch_tokens: int) -> float:
        """A small, a larger and a full-batch run, so the first request pays no allocation
        cost. The full batch also touches every page of the arena's first region, so the
        resident memory it adds is there from the start rather than creeping up under load
        as the arena spreads answers over it (which a soak saw as slow growth)."""
        started = time.perf_counter()
        for size in (8, 4096, batch_tokens):
            if size > 0:
                self._session.run(np.arange(size, dtype=np.int64) % self._session.vocab_size)
        return time.perf_counter() - started

    def _in_dtype(self, rows: np.ndarray, dtype: DType) -> np.ndarray:
        return rows if dtype == FLOAT32 else self._casts[dtype](rows)
