"""The dynamic batcher: a queue that forms batches. Many requests, one compute.

A look-up is per token, so requests of any lengths batch without padding: the items of
queued requests go to ``run`` together (the onnxruntime backend concatenates their ids
into one flat array, looks them up in one run and slices the rows back), and each caller
gets its own result.

When a batch goes:
- at once when no batch is computing (a lone request on an idle server never waits);
- otherwise when the queued tokens reach ``max_batch_tokens``, or the oldest request
  has waited ``max_delay_s``, whichever comes first, and a compute slot is free.
A batch takes requests in arrival order up to ``max_batch_tokens`` (a single larger
request goes alone). Requests whose caller went away or whose deadline passed are
dropped before compute.

It is a queue, not a second placement: whether a request queues at all, and where a
batch computes (on the loop or a thread), is the policy's (``core.policy``), asked by the
scheduler, whose ``run`` this calls. It knows nothing of gRPC or onnxruntime: ``run`` is
any coroutine from a list of items to a list of results, one each, in order; the token
count of each item is what the budget counts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from tokembed.server.core import deadlines
from tokembed.server.core.errors import DeadlineExceeded, EmbedError, Internal, Unavailable

logger = logging.getLogger(__name__)

ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")


@dataclass(slots=True)  # per request: slotted, not frozen (see types.py)
class BatchResult(Generic[ResultT]):
    result: ResultT  # this request's share of the batch's compute
    queue_s: float
    compute_s: float
    batch_requests: int
    batch_tokens: int


@dataclass
class _Pending(Generic[ItemT, ResultT]):
    item: ItemT
    tokens: int
    future: asyncio.Future[BatchResult[ResultT]]
    enqueued_at: float
    deadline: float | None  # time.monotonic() clock
    left_at: float | None = None  # when its caller was cancelled while it was queued


class Batcher(Generic[ItemT, ResultT]):
    def __init__(
        self,
        run: Callable[[list[ItemT]], Awaitable[list[ResultT]]],
        *,
        max_batch_tokens: int,
        max_delay_s: float,
        max_concurrent_batches: int = 1,
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        """``run(items)``: computes a batch, one result per item in order (it reports the
        batch); ``on_drop(reason)``: told of every queued request dropped before compute."""
        self._run = run
        self._max_batch_tokens = max_batch_tokens
        self._max_delay_s = max_delay_s
        self._max_concurrent = max_concurrent_batches
        self._on_drop = on_drop
        self._queue: collections.deque[_Pending[ItemT, ResultT]] = collections.deque()
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

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing computing."""
        return not self._queue and self._computing == 0

    async def submit(
        self, item: ItemT, tokens: int, deadline: float | None = None
    ) -> BatchResult[ResultT]:
        """Queue ``item`` (``tokens`` of the budget) for the next batch and wait for its
        result."""
        if self._closed:
            raise Unavailable("the server is shutting down")
        self._ensure_running()
        assert self._wakeup is not None
        future: asyncio.Future[BatchResult[ResultT]] = asyncio.get_running_loop().create_future()
        pending = _Pending(item, tokens, future, time.monotonic(), deadline)
        self._queue.append(pending)
        self._queued_tokens += tokens
        self._wakeup.set()
        # If the caller is cancelled here, the future is cancelled with it and the
        # dispatcher drops it before compute, saying why by when it left (the drop is
        # counted later, when the batch is taken, and its reason must not depend on that).
        try:
            return await future
        except asyncio.CancelledError:
            pending.left_at = time.monotonic()
            raise

    async def close(self) -> None:
        """Fail what is still queued, wait for batches computing now, stop the dispatcher."""
        self._closed = True
        while self._queue:
            item = self._queue.popleft()
            self._queued_tokens -= item.tokens
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

    def _take_batch(self) -> list[_Pending[ItemT, ResultT]]:
        batch: list[_Pending[ItemT, ResultT]] = []
        tokens = 0
        now = time.monotonic()
        while self._queue:
            item = self._queue[0]
            size = item.tokens
            if batch and tokens + size > self._max_batch_tokens:
                break
            self._queue.popleft()
            self._queued_tokens -= size
            if item.future.done():  # cancelled by its caller while queued
                left_at = now if item.left_at is None else item.left_at
                self._report_drop(deadlines.departure(item.deadline, left_at).reason)
                continue
            if deadlines.passed(item.deadline, now):
                item.future.set_exception(
                    DeadlineExceeded(f"deadline passed after {now - item.enqueued_at:.6f} s queued")
                )
                self._report_drop("deadline_exceeded")
                continue
            batch.append(item)
            tokens += size
        return batch

    async def _run_batch(self, batch: list[_Pending[ItemT, ResultT]]) -> None:
        tokens = sum(item.tokens for item in batch)
        started = time.monotonic()
        try:
            answers = await self._run([item.item for item in batch])
            if len(answers) != len(batch):
                raise Internal(f"this is a bug: {len(answers)} results for {len(batch)} requests")
            compute_s = time.monotonic() - started
        except Exception as exc:
            # A domain error (Overloaded, Unavailable...) reaches the callers as it is, as
            # it does from a compute outside the batcher; anything else is Internal.
            error = exc if isinstance(exc, EmbedError) else Internal(f"the look-up failed: {exc}")
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(error)
            return
        finally:
            self._computing -= 1
            if self._wakeup is not None:
                self._wakeup.set()
        for item, answer in zip(batch, answers, strict=True):
            if not item.future.done():
                item.future.set_result(
                    BatchResult(
                        result=answer,
                        queue_s=started - item.enqueued_at,
                        compute_s=compute_s,
                        batch_requests=len(batch),
                        batch_tokens=tokens,
                    )
                )
        # The dispatcher's loop variable holds this list until it takes the next batch,
        # and each future in it holds its answer: one large answer stayed resident after
        # the server went idle. Let go of them here.
        batch.clear()

    def _report_drop(self, reason: str) -> None:
        # A reporter (metrics) that fails must not strand the rest of the queue.
        if self._on_drop is not None:
            try:
                self._on_drop(reason)
            except Exception:
                logger.exception("drop report failed; this is a bug")
