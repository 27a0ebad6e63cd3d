"""The dynamic batcher, a queue, with a fake ``run`` whose output rows reveal their ids.

Each request's item is its ids; the fake ``run`` computes on a thread (as the scheduler's
does for a large batch), concatenates a batch's ids (as the onnxruntime backend does) and
maps them to rows where every value of row i equals ids[i], then slices them back, so a
request's rows prove that it got exactly its own ids back, in order. It can block on a
``threading.Event`` (a busy runtime) and it records every batch it is given, so a test
can prove what was (and was not) computed, and in which batches.

Where a batch computes (on the loop or a thread) and whether a request queues at all are
the policy's and the scheduler's (tests/server/test_policy.py, test_scheduler.py); the
batcher only forms the batches and hands them to ``run``.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
import pytest

from tokembed.server.core.batcher import Batcher, BatchResult
from tokembed.server.core.deadlines import DEADLINE_SLACK_S
from tokembed.server.core.errors import DeadlineExceeded, Internal, Unavailable

T = TypeVar("T")
D = 4
BLOCK = 999  # a batch holding this id blocks in compute until the gate opens
FAIL = 666  # a batch holding this id makes compute raise
# A max_delay far beyond any stall of a loaded machine (a loop turn there takes up to ~0.1 s
# on the 2-core development machine with both cores busy): a batch that goes within half
# of it went for another reason (an idle runtime, a full budget), and one that wrongly
# waited for it fails its test's bound, not run()'s.
LONG_DELAY_S = 20.0


def rows_of(ids: np.ndarray) -> np.ndarray:
    return np.repeat(ids[:, None].astype(np.float32), D, axis=1)


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def item(*values: int) -> tuple[np.ndarray, int]:
    """A request's item and its token count, as ``submit`` takes them."""
    return ids(*values), len(values)


def sized(request: np.ndarray) -> tuple[np.ndarray, int]:
    return request, int(request.size)


def sliced(
    compute: Callable[[np.ndarray], np.ndarray],
) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
    """A compute over a batch of id arrays: one call for all, rows sliced back."""

    def batch(items: list[np.ndarray]) -> list[np.ndarray]:
        rows = compute(np.concatenate(items))
        bounds = np.cumsum([len(i) for i in items])[:-1]
        return list(np.split(rows, bounds))

    return batch


class FakeCompute:
    """ids -> rows_of(ids); records calls; blocks on BLOCK, raises on FAIL."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.threads: list[int] = []  # the thread of each call, in order
        self.gate = threading.Event()
        self.blocked = threading.Event()  # set once a blocking call has started
        self._lock = threading.Lock()

    def __call__(self, batch_ids: np.ndarray) -> np.ndarray:
        with self._lock:
            self.calls.append([int(i) for i in batch_ids])
            self.threads.append(threading.get_ident())
        if BLOCK in batch_ids:
            self.blocked.set()
            if not self.gate.wait(10):
                raise RuntimeError("test gate never opened")
        if FAIL in batch_ids:
            raise ValueError("the fake runtime broke")
        return rows_of(batch_ids)

    def seen(self) -> set[int]:
        return {i for call in self.calls for i in call}


class Recorder:
    """What the batcher handed to ``run`` (requests and tokens of each batch, in order,
    whether its compute then failed or not) and every drop it told of."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int]] = []
        self.drops: list[str] = []

    def given(self, items: Sequence[np.ndarray]) -> None:
        self.batches.append((len(items), sum(len(i) for i in items)))

    def dropped(self, reason: str) -> None:
        self.drops.append(reason)


def run(coro: Coroutine[Any, Any, T], timeout_s: float = 10) -> T:
    """Run one test coroutine on a fresh loop, bounded in time."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


async def until(
    predicate: Callable[[], bool], timeout_s: float = 5, failure: str = "condition not reached"
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{failure} in {timeout_s} s")
        await asyncio.sleep(0.001)


async def wait_event(event: threading.Event, timeout_s: float = 5) -> None:
    assert await asyncio.to_thread(event.wait, timeout_s), "event not set in time"


@contextmanager
def fake_batcher(
    *,
    max_batch_tokens: int = 1000,
    max_delay_s: float = 1.0,
    max_concurrent_batches: int = 1,
) -> Iterator[tuple[Batcher[np.ndarray, np.ndarray], FakeCompute, Recorder]]:
    compute = FakeCompute()
    observer = Recorder()
    executor = ThreadPoolExecutor(max_workers=4)
    batch = sliced(compute)

    async def run(items: list[np.ndarray]) -> list[np.ndarray]:
        observer.given(items)
        return await asyncio.get_running_loop().run_in_executor(executor, batch, items)

    batcher: Batcher[np.ndarray, np.ndarray] = Batcher(
        run,
        max_batch_tokens=max_batch_tokens,
        max_delay_s=max_delay_s,
        max_concurrent_batches=max_concurrent_batches,
        on_drop=observer.dropped,
    )
    try:
        yield batcher, compute, observer
    finally:
        compute.gate.set()  # never leave a worker thread blocked
        executor.shutdown(wait=True)


def assert_own_rows(result: BatchResult[np.ndarray], sent: np.ndarray) -> None:
    np.testing.assert_array_equal(result.result, rows_of(sent))


async def closing(batcher: Batcher[Any, Any], body: Awaitable[T]) -> T:
    try:
        return await body
    finally:
        await batcher.close()


def test_lone_request_on_idle_batcher_does_not_wait_for_max_delay() -> None:
    with fake_batcher(max_delay_s=LONG_DELAY_S) as (batcher, compute, observer):

        async def body() -> tuple[BatchResult[np.ndarray], float]:
            started = time.monotonic()
            result = await batcher.submit(*item(3, 1, 4))
            return result, time.monotonic() - started

        result, elapsed = run(closing(batcher, body()), timeout_s=LONG_DELAY_S + 10)
    assert elapsed < LONG_DELAY_S / 2, f"a lone request waited {elapsed:.3f} s for max_delay"
    assert_own_rows(result, ids(3, 1, 4))
    assert (result.batch_requests, result.batch_tokens) == (1, 3)
    assert result.queue_s < LONG_DELAY_S / 2
    assert compute.calls == [[3, 1, 4]]
    assert observer.batches == [(1, 3)]
    assert batcher.queued_tokens == 0


def test_requests_arriving_during_a_batch_go_together_as_one_batch() -> None:
    with fake_batcher(max_delay_s=LONG_DELAY_S) as (batcher, compute, observer):
        sent = [ids(10, 11), ids(20), ids(30, 31, 32, 33), ids(40, 41, 42)]

        async def body() -> tuple[list[BatchResult[np.ndarray]], float]:
            first = asyncio.ensure_future(batcher.submit(*item(BLOCK)))
            await wait_event(compute.blocked)
            tasks = [asyncio.ensure_future(batcher.submit(*sized(s))) for s in sent]
            await until(lambda: batcher.queued_requests == len(sent))
            assert batcher.queued_tokens == sum(s.size for s in sent)
            await asyncio.sleep(0.05)  # a chance to run them wrongly beside the busy batch
            assert not any(t.done() for t in tasks), "queued requests ran while busy"
            released = time.monotonic()
            compute.gate.set()
            results = await asyncio.gather(*tasks)
            elapsed = time.monotonic() - released
            await first
            return results, elapsed

        results, elapsed = run(closing(batcher, body()), timeout_s=LONG_DELAY_S + 10)
    total = sum(s.size for s in sent)
    assert compute.calls == [[BLOCK], [int(i) for s in sent for i in s]]
    for result, s in zip(results, sent, strict=True):
        assert_own_rows(result, s)
        assert (result.batch_requests, result.batch_tokens) == (len(sent), total)
        assert result.queue_s >= 0.05  # they really waited for the busy runtime
    # Once the runtime is free the waiting batch goes at once, not after max_delay.
    assert elapsed < LONG_DELAY_S / 2, elapsed
    assert observer.batches == [(1, 1), (len(sent), total)]
    assert batcher.queued_tokens == 0


def test_token_budget_splits_batches_and_an_oversized_request_goes_alone() -> None:
    with fake_batcher(max_batch_tokens=10, max_delay_s=1.0) as (batcher, compute, observer):
        sent = [
            ids(1, 1, 1, 1),
            ids(2, 2, 2, 2),
            ids(3, 3, 3, 3),  # 12 > 10: starts the next batch
            ids(*([4] * 25)),  # bigger than the budget: alone
            ids(5, 5, 5),
        ]

        async def body() -> list[BatchResult[np.ndarray]]:
            first = asyncio.ensure_future(batcher.submit(*item(BLOCK)))
            await wait_event(compute.blocked)
            tasks = [asyncio.ensure_future(batcher.submit(*sized(s))) for s in sent]
            await until(lambda: batcher.queued_requests == len(sent))
            compute.gate.set()
            results = await asyncio.gather(*tasks)
            await first
            return results

        results = run(closing(batcher, body()))
    assert compute.calls == [
        [BLOCK],
        [1, 1, 1, 1, 2, 2, 2, 2],
        [3, 3, 3, 3],
        [4] * 25,
        [5, 5, 5],
    ]
    assert observer.batches == [(1, 1), (2, 8), (1, 4), (1, 25), (1, 3)]
    for result, s in zip(results, sent, strict=True):
        assert_own_rows(result, s)
    assert batcher.queued_tokens == 0


def test_max_delay_bounds_the_wait_while_another_batch_computes() -> None:
    max_delay = 0.5
    with fake_batcher(max_delay_s=max_delay, max_concurrent_batches=2) as (
        batcher,
        compute,
        observer,
    ):

        async def body() -> tuple[BatchResult[np.ndarray], float, bool]:
            first = asyncio.ensure_future(batcher.submit(*item(BLOCK)))
            await wait_event(compute.blocked)
            started = time.monotonic()
            result = await batcher.submit(*item(7, 8))
            elapsed = time.monotonic() - started
            first_still_busy = not first.done()
            compute.gate.set()
            await first
            return result, elapsed, first_still_busy

        result, elapsed, first_still_busy = run(closing(batcher, body()))
    assert first_still_busy, "the second request should run beside the busy batch"
    # It waited for company (the runtime was busy): its batch went no earlier than max_delay
    # after it was queued (queue_s is the batcher's own measure, queued to batch started).
    assert result.queue_s >= max_delay - 1e-6, result.queue_s
    assert elapsed >= result.queue_s, elapsed
    # ... and no longer than max_delay: not until the busy batch ended (first_still_busy),
    # nor twice max_delay. The slack (max_delay itself) is for the dispatcher's turn after
    # its timer fires; the worst seen, with both cores of the 2-core machine busy, was 27 ms.
    assert result.queue_s < 2 * max_delay, result.queue_s
    assert_own_rows(result, ids(7, 8))
    assert compute.calls == [[BLOCK], [7, 8]]
    assert observer.batches == [(1, 1), (1, 2)]  # the second went beside the busy first


def test_full_token_budget_goes_before_max_delay_while_busy() -> None:
    with fake_batcher(max_batch_tokens=6, max_delay_s=LONG_DELAY_S, max_concurrent_batches=2) as (
        batcher,
        compute,
        observer,
    ):

        async def body() -> float:
            first = asyncio.ensure_future(batcher.submit(*item(BLOCK)))
            await wait_event(compute.blocked)
            started = time.monotonic()
            results = await asyncio.gather(
                batcher.submit(*item(1, 2, 3)), batcher.submit(*item(4, 5, 6))
            )
            elapsed = time.monotonic() - started
            assert_own_rows(results[0], ids(1, 2, 3))
            assert_own_rows(results[1], ids(4, 5, 6))
            compute.gate.set()
            await first
            return elapsed

        elapsed = run(closing(batcher, body()), timeout_s=LONG_DELAY_S + 10)
    assert elapsed < LONG_DELAY_S / 2, f"a full batch waited {elapsed:.3f} s for max_delay"
    assert compute.calls == [[BLOCK], [1, 2, 3, 4, 5, 6]]
    assert observer.batches == [(1, 1), (2, 6)]


def test_cancelled_caller_is_dropped_before_compute() -> None:
    with fake_batcher() as (batcher, compute, observer):

        async def body() -> BatchResult[np.ndarray]:
            first = asyncio.ensure_future(batcher.submit(*item(BLOCK)))
            await wait_event(compute.blocked)
            doomed = asyncio.ensure_future(batcher.submit(*item(777, 778)))
            kept = asyncio.ensure_future(batcher.submit(*item(5)))
            await until(lambda: batcher.queued_requests == 2)
            doomed.cancel()
            with pytest.raises(asyncio.CancelledError):
                await doomed
            compute.gate.set()
            result = await kept
            await first
            return result

        result = run(closing(batcher, body()))
    assert 777 not in compute.seen() and 778 not in compute.seen()
    assert compute.calls == [[BLOCK], [5]]
    assert_own_rows(result, ids(5))
    assert result.batch_requests == 1
    assert observer.drops == ["cancelled"]
    assert batcher.queued_tokens == 0


def test_a_drop_is_counted_by_why_its_caller_left_not_by_when_the_batch_is_taken() -> None:
    """A caller cancelled well before its deadline went away; one cancelled within
    DEADLINE_SLACK_S of it ran out of time (its own timer fires just before the server's).
    The drop is counted when the next batch is taken, here after both deadlines: each
    reason is the one of the moment its caller left, as the call's status says."""
    with fake_batcher() as (batcher, compute, observer):

        async def body() -> None:
            first = asyncio.ensure_future(batcher.submit(*item(BLOCK)))
            await wait_event(compute.blocked)
            # Far enough that no stall before the cancel below reaches DEADLINE_SLACK_S of it.
            far = time.monotonic() + 1.0
            left_early = asyncio.ensure_future(batcher.submit(*item(601), far))
            near = time.monotonic() + DEADLINE_SLACK_S / 2
            timed_out = asyncio.ensure_future(batcher.submit(*item(602), near))
            await until(lambda: batcher.queued_requests == 2)
            left_early.cancel()
            timed_out.cancel()
            for task in (left_early, timed_out):
                with pytest.raises(asyncio.CancelledError):
                    await task
            await asyncio.sleep(far - time.monotonic() + 0.01)  # both deadlines pass
            compute.gate.set()
            await first

        run(closing(batcher, body()))
    assert compute.calls == [[BLOCK]]
    assert observer.drops == ["cancelled", "deadline_exceeded"]
    assert batcher.queued_tokens == 0


def test_expired_deadline_raises_and_is_never_computed() -> None:
    with fake_batcher() as (batcher, compute, observer):

        async def body() -> None:
            # Already expired on arrival, on an idle batcher.
            with pytest.raises(DeadlineExceeded, match="deadline passed"):
                await batcher.submit(*item(501), deadline=time.monotonic() - 0.001)
            # Expires while it waits behind a busy batch.
            first = asyncio.ensure_future(batcher.submit(*item(BLOCK)))
            await wait_event(compute.blocked)
            late = asyncio.ensure_future(batcher.submit(*item(502), time.monotonic() + 0.05))
            on_time = asyncio.ensure_future(batcher.submit(*item(503), time.monotonic() + 5))
            await asyncio.sleep(0.1)
            compute.gate.set()
            with pytest.raises(DeadlineExceeded):
                await late
            assert_own_rows(await on_time, ids(503))
            await first

        run(closing(batcher, body()))
    assert 501 not in compute.seen() and 502 not in compute.seen()
    assert compute.calls == [[BLOCK], [503]]
    assert observer.drops == ["deadline_exceeded", "deadline_exceeded"]
    assert batcher.queued_tokens == 0


def test_compute_failure_fails_every_caller_of_the_batch_and_the_next_batch_works() -> None:
    with fake_batcher() as (batcher, compute, observer):

        async def body() -> BatchResult[np.ndarray]:
            first = asyncio.ensure_future(batcher.submit(*item(BLOCK)))
            await wait_event(compute.blocked)
            mates = [
                asyncio.ensure_future(batcher.submit(*item(1, 2))),
                asyncio.ensure_future(batcher.submit(*item(FAIL))),
                asyncio.ensure_future(batcher.submit(*item(3))),
            ]
            await until(lambda: batcher.queued_requests == 3)
            compute.gate.set()
            outcomes = await asyncio.gather(*mates, return_exceptions=True)
            for outcome in outcomes:
                assert isinstance(outcome, Internal), outcome
                assert "the fake runtime broke" in str(outcome)
            await first
            return await batcher.submit(*item(4, 5))

        result = run(closing(batcher, body()))
    assert compute.calls == [[BLOCK], [1, 2, FAIL, 3], [4, 5]]
    # The failed batch was run once; reporting batches (done ones only) is the scheduler's.
    assert observer.batches == [(1, 1), (3, 4), (1, 2)]
    assert_own_rows(result, ids(4, 5))
    assert batcher.queued_tokens == 0


def test_close_fails_queued_requests_with_unavailable_and_lets_running_batches_finish() -> None:
    with fake_batcher() as (batcher, compute, observer):

        async def body() -> None:
            first = asyncio.ensure_future(batcher.submit(*item(BLOCK, 9)))
            await wait_event(compute.blocked)
            queued = [
                asyncio.ensure_future(batcher.submit(*item(11))),
                asyncio.ensure_future(batcher.submit(*item(12, 13))),
            ]
            await until(lambda: batcher.queued_requests == 2)
            closer = asyncio.ensure_future(batcher.close())
            # Queued requests fail at once, while the running batch is still busy.
            outcomes = await asyncio.gather(*queued, return_exceptions=True)
            assert all(isinstance(o, Unavailable) for o in outcomes), outcomes
            assert not first.done()
            assert batcher.queued_tokens == 0
            compute.gate.set()
            assert_own_rows(await first, ids(BLOCK, 9))
            await closer
            with pytest.raises(Unavailable):
                await batcher.submit(*item(1))

        run(body())
    assert compute.calls == [[BLOCK, 9]]
    assert observer.batches == [(1, 2)]
    assert batcher.queued_tokens == 0


def test_queued_tokens_return_to_zero_after_a_mixed_load() -> None:
    with fake_batcher(max_batch_tokens=16, max_delay_s=0.005, max_concurrent_batches=2) as (
        batcher,
        compute,
        observer,
    ):
        rng = np.random.default_rng(0)
        sent = [rng.integers(0, 500, size=int(rng.integers(1, 12))) for _ in range(200)]

        async def body() -> list[BatchResult[np.ndarray] | BaseException]:
            tasks = [
                asyncio.ensure_future(
                    batcher.submit(*sized(s), time.monotonic() - 1 if n % 17 == 0 else None)
                )
                for n, s in enumerate(sent)
            ]
            await asyncio.sleep(0)
            for task in tasks[5::23]:
                task.cancel()
            return await asyncio.gather(*tasks, return_exceptions=True)

        outcomes = run(closing(batcher, body()))
    assert batcher.queued_tokens == 0
    assert batcher.queued_requests == 0
    cancelled = {n for n in range(len(sent)) if n % 23 == 5}
    expired = {n for n in range(len(sent)) if n % 17 == 0} - cancelled
    for n, (outcome, s) in enumerate(zip(outcomes, sent, strict=True)):
        if n in cancelled:
            assert isinstance(outcome, asyncio.CancelledError), (n, outcome)
        elif n in expired:
            assert isinstance(outcome, DeadlineExceeded), (n, outcome)
        else:
            assert isinstance(outcome, BatchResult), (n, outcome)
            assert_own_rows(outcome, s)
    # Cancelled before the dispatcher ran, so every one was dropped, never computed; one
    # both cancelled and expired counts as expired.
    expired_all = {n for n in range(len(sent)) if n % 17 == 0}
    assert sorted(observer.drops) == sorted(
        ["cancelled"] * len(cancelled - expired_all) + ["deadline_exceeded"] * len(expired_all)
    )
    served_tokens = sum(sent[n].size for n in range(len(sent)) if n not in cancelled | expired)
    assert sum(tokens for _, tokens in observer.batches) == served_tokens
    assert sum(len(call) for call in compute.calls) == served_tokens
    # The load did form multi-request batches, none over budget unless a lone request.
    assert max(requests for requests, _ in observer.batches) > 1
    assert all(tokens <= 16 or requests == 1 for requests, tokens in observer.batches)


# --- what ``run`` gives back, and when the batcher is idle


@pytest.mark.parametrize(
    ("run_result", "message"),
    [("short", "0 results for 1 requests"), ("raises", "the look-up failed: it broke")],
)
def test_a_run_that_fails_or_gives_the_wrong_number_of_results_is_internal(
    run_result: str, message: str
) -> None:
    async def failing(items: list[np.ndarray]) -> list[np.ndarray]:
        if run_result == "raises":
            raise ValueError("it broke")
        return [rows_of(i) for i in items][:-1]

    async def body() -> None:
        batcher: Batcher[np.ndarray, np.ndarray] = Batcher(
            failing, max_batch_tokens=100, max_delay_s=0.01
        )
        try:
            with pytest.raises(Internal, match=message):
                await batcher.submit(*item(1, 2, 3))
            assert batcher.idle  # and ready for the next batch
        finally:
            await batcher.close()

    run(body())


def test_an_internal_error_of_run_reaches_the_callers_as_it_is() -> None:
    # The scheduler's run raises Internal with its own message: not wrapped a second time.
    async def failing(items: list[np.ndarray]) -> list[np.ndarray]:
        raise Internal("this is a bug: the look-up gave 2 results for 3 requests")

    async def body() -> None:
        batcher: Batcher[np.ndarray, np.ndarray] = Batcher(
            failing, max_batch_tokens=100, max_delay_s=0.01
        )
        try:
            with pytest.raises(Internal) as caught:
                await batcher.submit(*item(1))
            assert str(caught.value) == "this is a bug: the look-up gave 2 results for 3 requests"
        finally:
            await batcher.close()

    run(body())


def test_idle_is_nothing_queued_and_nothing_computing() -> None:
    """``idle`` is what the policy weighs (a small request beside an idle batcher computes
    at once, alone): false from a submit until its batch has returned, and while anything
    waits in the queue."""
    with fake_batcher() as (batcher, compute, _observer):

        async def body() -> None:
            assert batcher.idle  # new
            first = asyncio.ensure_future(batcher.submit(*item(BLOCK)))
            await asyncio.sleep(0)  # the submit ran: queued (or computing)
            assert not batcher.idle
            await wait_event(compute.blocked)
            assert not batcher.idle and batcher.queued_requests == 0  # computing
            second = asyncio.ensure_future(batcher.submit(*item(5)))
            await until(lambda: batcher.queued_requests == 1)
            assert not batcher.idle
            compute.gate.set()
            await first
            await second
            await until(lambda: batcher.idle)  # the second's batch has returned
            assert batcher.queued_tokens == 0

        run(closing(batcher, body()))
    assert compute.calls == [[BLOCK], [5]]


def test_an_answered_batch_keeps_no_rows_alive_while_the_batcher_idles() -> None:
    """Fix: the dispatcher's loop variable held the last batch, whose futures held their
    answers' rows: one [32,512] answer (33.5 MB) stayed resident after the server went
    idle, until the next batch replaced it."""
    with fake_batcher(max_delay_s=0.01) as (batcher, _compute, _observer):

        async def body() -> None:
            first, second = await asyncio.gather(
                batcher.submit(*item(1, 2)), batcher.submit(*item(3))
            )
            assert first.result.base is not None and first.result.base is second.result.base
            computed = weakref.ref(first.result.base)
            del first, second

            def freed() -> bool:
                gc.collect()
                return computed() is None

            # Waited for: the executor's worker thread lets go of its finished job (whose
            # result holds the rows) only after the loop has the answer, a moment later on
            # a busy core. The bug held them until the next batch, on an idle batcher never.
            # Checked before close(), which ends the dispatcher and would free them anyway.
            await until(freed, failure="the batcher still held an answered batch's rows")

        run(closing(batcher, body()))
