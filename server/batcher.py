"""The dynamic batcher: many requests, one look-up.

A look-up is per token, so requests of any lengths batch without padding: the ids of
queued requests are concatenated into one flat array, looked up once, and the output
rows are sliced back per request (views, no copy).

When a batch goes:
- at once when no batch is computing (a lone request on an idle server never waits);
- otherwise when the queued tokens reach ``max_batch_tokens``, or the oldest request
  has waited ``max_delay_s``, whichever comes first, and a compute slot is free.
A batch takes requests in arrival order up to ``max_batch_tokens`` (a single larger
request goes alone). Requests whose caller went away or whose deadline passed are
dropped before compute.

With ``rows_per_request`` the batch still travels as one (one queue slot, one thread hop)
but each request's rows are looked up on their own, so every answer owns its memory and
is freed once it is sent instead of keeping a shared batch array alive until the last
batch-mate is done. For a look-up that costs the same per row however it is split (a
table gather) that loses nothing; onnxruntime's per-call cost is why it is not the default.

It knows nothing of gRPC or onnxruntime: ``compute`` is any function ids -> rows.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tokembed.server.errors import DeadlineExceeded, Internal, Unavailable

logger = logging.getLogger(__name__)

Compute = Callable[[np.ndarray], np.ndarray]


class BatchObserver(Protocol):
    """What the batcher reports (metrics implement it)."""

    def batch_done(self, requests: int, tokens: int, compute_s: float) -> None: ...

    def dropped(self, reason: str) -> None: ...


@dataclass(slots=True)  # per request: slotted, not frozen (see domain.py)
class BatchResult:
    rows: np.ndarray  # [n, D]: this request's rows, a view into the batch output
    queue_s: float
    compute_s: float
    batch_requests: int
    batch_tokens: int


@dataclass
class _Pending:
    ids: np.ndarray
    future: asyncio.Future[BatchResult]
    enqueued_at: float
    deadline: float | None  # time.monotonic() clock


class Batcher:
    def __init__(
        self,
        compute: Compute,
        executor: Executor | None,
        *,
        max_batch_tokens: int,
        max_delay_s: float,
        max_concurrent_batches: int = 1,
        inline_max_tokens: int = 0,
        observer: BatchObserver | None = None,
        rows_per_request: bool = False,
    ) -> None:
        self._compute = compute
        self._rows_per_request = rows_per_request
        self._executor = executor
        self._max_batch_tokens = max_batch_tokens
        self._max_delay_s = max_delay_s
        self._max_concurrent = max_concurrent_batches
        self._observer = observer
        self._inline_max_tokens = inline_max_tokens
        self._queue: collections.deque[_Pending] = collections.deque()
        self._queued_tokens = 0
        self._computing = 0
        self._closed = False
        # Created inside the running loop on first use (not in __init__!), so they
        # belong to the loop that serves the requests.
        self._wakeup: asyncio.Event | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._batch_tasks: set[asyncio.Task[None]] = set()

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def queued_requests(self) -> int:
        return len(self._queue)

    async def submit(self, ids: np.ndarray, deadline: float | None = None) -> BatchResult:
        """Queue ``ids`` (int64 [n]) for the next batch and wait for its rows."""
        if self._closed:
            raise Unavailable("the server is shutting down")
        alone = self.try_alone_now(ids, deadline)
        if alone is not None:
            return alone
        self._ensure_running()
        assert self._wakeup is not None
        future: asyncio.Future[BatchResult] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(ids, future, time.monotonic(), deadline))
        self._queued_tokens += int(ids.size)
        self._wakeup.set()
        # If the caller is cancelled here, the future is cancelled with it and the
        # dispatcher drops it before compute.
        return await future

    def try_alone_now(self, ids: np.ndarray, deadline: float | None = None) -> BatchResult | None:
        """A batch of these ids alone, looked up right here, if the batcher is idle and
        they are few (see ``_compute_alone_inline``); None, with nothing done, if they
        must queue (or the deadline has passed: queued, they are dropped as expired)."""
        if (
            not self._closed
            and not self._queue
            and self._computing == 0
            and ids.size <= self._inline_max_tokens
            and (deadline is None or deadline > time.monotonic())
        ):
            return self._compute_alone_inline(ids)
        return None

    def _compute_alone_inline(self, ids: np.ndarray) -> BatchResult:
        """The idle fast path: a lone small request is a batch of one, looked up right here.

        No queue, no task, no thread hop: on an idle server these cost more than the
        look-up itself (~10 us for a few tokens). Nothing else runs meanwhile, so the
        event loop is blocked no longer than by any other small step.
        """
        started = time.monotonic()
        try:
            # Fix: checked as in _run_batch; a short answer must not reach the caller.
            rows = self._checked_compute(ids)
        except Exception as exc:
            logger.exception("look-up failed for a batch of 1 request")
            raise Internal(f"the look-up failed: {exc}") from exc
        compute_s = time.monotonic() - started
        self.report_batch(1, int(ids.size), compute_s)
        return BatchResult(rows, 0.0, compute_s, 1, int(ids.size))

    async def close(self) -> None:
        """Fail what is still queued, wait for batches computing now, stop the dispatcher."""
        self._closed = True
        while self._queue:
            item = self._queue.popleft()
            self._queued_tokens -= int(item.ids.size)
            if not item.future.done():
                item.future.set_exception(Unavailable("the server is shutting down"))
        if self._batch_tasks:
            await asyncio.gather(*self._batch_tasks, return_exceptions=True)
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dispatcher

    # --- inside the loop

    def _ensure_running(self) -> None:
        if self._dispatcher is None or self._dispatcher.done():
            self._wakeup = asyncio.Event()
            self._dispatcher = asyncio.get_running_loop().create_task(
                self._dispatch_forever(), name="tokembed-batcher"
            )

    async def _dispatch_forever(self) -> None:
        assert self._wakeup is not None
        wakeup = self._wakeup
        while True:
            await wakeup.wait()
            wakeup.clear()
            while self._queue and self._computing < self._max_concurrent:
                wait_s = self._time_until_due()
                if wait_s > 0:
                    # Busy and not full: give the batch up to max_delay to fill, but
                    # wake at once when more arrives or a slot frees up.
                    try:
                        await asyncio.wait_for(wakeup.wait(), timeout=wait_s)
                        wakeup.clear()
                    except TimeoutError:
                        pass
                    continue
                batch = self._take_batch()
                if batch:
                    self._computing += 1
                    task = asyncio.get_running_loop().create_task(self._run_batch(batch))
                    self._batch_tasks.add(task)
                    task.add_done_callback(self._batch_tasks.discard)

    def _time_until_due(self) -> float:
        """0 when the head of the queue should go now; else seconds until it must."""
        if self._computing == 0 or self._queued_tokens >= self._max_batch_tokens:
            return 0.0
        oldest = self._queue[0].enqueued_at
        return max(0.0, oldest + self._max_delay_s - time.monotonic())

    def _take_batch(self) -> list[_Pending]:
        batch: list[_Pending] = []
        tokens = 0
        now = time.monotonic()
        while self._queue:
            item = self._queue[0]
            size = int(item.ids.size)
            if batch and tokens + size > self._max_batch_tokens:
                break
            self._queue.popleft()
            self._queued_tokens -= size
            if item.future.done():  # cancelled by its caller while queued
                expired = item.deadline is not None and item.deadline <= now
                self._report_drop("deadline_exceeded" if expired else "cancelled")
                continue
            if item.deadline is not None and item.deadline <= now:
                item.future.set_exception(
                    DeadlineExceeded(f"deadline passed after {now - item.enqueued_at:.6f} s queued")
                )
                self._report_drop("deadline_exceeded")
                continue
            batch.append(item)
            tokens += size
        return batch

    async def _run_batch(self, batch: list[_Pending]) -> None:
        tokens = sum(int(item.ids.size) for item in batch)
        started = time.monotonic()
        try:
            if tokens <= self._inline_max_tokens:
                # Cheaper than a thread hop; see _compute_alone_inline.
                answers = self._look_up(batch)
            else:
                loop = asyncio.get_running_loop()
                answers = await loop.run_in_executor(self._executor, self._look_up, batch)
            compute_s = time.monotonic() - started
        except Exception as exc:
            logger.exception("look-up failed for a batch of %d requests", len(batch))
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(Internal(f"the look-up failed: {exc}"))
            return
        finally:
            self._computing -= 1
            if self._wakeup is not None:
                self._wakeup.set()
        self.report_batch(len(batch), tokens, compute_s)
        for item, rows in zip(batch, answers, strict=True):
            if not item.future.done():
                item.future.set_result(
                    BatchResult(
                        rows=rows,
                        queue_s=started - item.enqueued_at,
                        compute_s=compute_s,
                        batch_requests=len(batch),
                        batch_tokens=tokens,
                    )
                )
        # Fix: the dispatcher's loop variable holds this list until it takes the next
        # batch, and each future in it holds its answer's rows: one [32,512] answer
        # (33.5 MB) stayed resident after the server went idle. Let go of them here.
        batch.clear()

    def _look_up(self, batch: list[_Pending]) -> list[np.ndarray]:
        """Each request's rows: slices of one look-up, or looked up one by one."""
        if self._rows_per_request:
            return [self._checked_compute(item.ids) for item in batch]
        if len(batch) == 1:
            return [self._checked_compute(batch[0].ids)]
        rows = self._checked_compute(np.concatenate([item.ids for item in batch]))
        answers, offset = [], 0
        for item in batch:
            size = int(item.ids.size)
            answers.append(rows[offset : offset + size])
            offset += size
        return answers

    def _checked_compute(self, ids: np.ndarray) -> np.ndarray:
        rows = self._compute(ids)
        if rows.shape[0] != ids.size:
            raise RuntimeError(f"compute returned {rows.shape[0]} rows for {ids.size} ids")
        return rows

    def report_batch(self, requests: int, tokens: int, compute_s: float) -> None:
        """Tell the observer of a look-up; public for the look-ups the service does itself
        (large answers gathered in place), so that they are reported the same way."""
        # An observer (metrics) that fails must not leave a batch's callers hanging.
        if self._observer is not None:
            try:
                self._observer.batch_done(requests, tokens, compute_s)
            except Exception:
                logger.exception("batch observer failed; this is a bug")

    def _report_drop(self, reason: str) -> None:
        if self._observer is not None:
            self._observer.dropped(reason)
