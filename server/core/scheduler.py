"""One served model version's compute: admit, place, batch, run, report.

Generic over operations (``core.operations``): an operation validates its request into a
job, and the scheduler takes it from there, the same way for every operation:

- ``admit``: the job's room (queued tokens of this model, output bytes of the process),
  or ``Overloaded`` at once;
- ``run``: the placement the policy decides (``core.policy``, asked once per request and
  once per batch), the one deadline check before compute (a queued request is checked by
  its batcher when its batch is taken), the compute, one report per compute, the
  operation's answer, and the caller's ``frame`` of it (its protocol's encoding), on the
  thread that computed when the answer is large.

It knows nothing of protocols: errors are ``core.errors``; ``frame`` is the caller's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from tokembed.server.core import deadlines
from tokembed.server.core.admission import Admission, OutputBudget, Ticket
from tokembed.server.core.batcher import Batcher
from tokembed.server.core.errors import DeadlineExceeded, EmbedError, Internal, Unavailable
from tokembed.server.core.operations.base import Costed, Job, Operation
from tokembed.server.core.policy import Placement, Policy
from tokembed.server.core.served import ServedModel
from tokembed.server.core.types import Answer, Timings

logger = logging.getLogger(__name__)

F = TypeVar("F")
# Threads per model for text operations: each request's batch encode already runs on the
# tokenizers library's own threads, so a few requests at once keep the cores busy.
TEXT_THREADS = 4
_Item = tuple[Operation[Any, Any, Any], Job]


def _queued_in(batchers: dict[Hashable, Batcher[_Item, Any]]) -> int:
    # A snapshot: the metrics thread asks while the loop may add a batcher.
    return sum(batcher.queued_tokens for batcher in list(batchers.values()))


def _queued_light(batchers: dict[Hashable, Batcher[_Item, Any]], heavy: set[Hashable]) -> int:
    """Tokens waiting in the batchers of the operations that are not heavy."""
    return sum(batcher.queued_tokens for key, batcher in list(batchers.items())
               if key not in heavy)  # fmt: skip


def _queued_work(
    batchers: dict[Hashable, Batcher[_Item, Any]], heavy: set[Hashable], row_flops: int
) -> int:
    """The flops waiting in the heavy batchers: each queued vector is one row of a multiply
    over the whole table, ``row_flops`` (``2 D V``)."""
    return row_flops * sum(batchers[key].queued_tokens for key in list(heavy))


class SchedulerObserver(Protocol):
    """What the scheduler reports (the metrics implement it)."""

    def batch_done(self, model: str, requests: int, tokens: int, compute_s: float) -> None: ...

    def dropped(self, model: str, reason: str) -> None: ...


class Scheduler:
    def __init__(
        self,
        served: ServedModel,
        *,
        policy: Policy,
        budget: OutputBudget,
        workers: Executor,
        observer: SchedulerObserver | None = None,
    ) -> None:
        """``workers``: threads for off-loop computes and frames (shared by the models);
        ``budget``: the process's output bytes in flight (shared by the models)."""
        self.served = served
        self._policy = policy
        self._workers = workers
        self._observer = observer
        self._batchers: dict[Hashable, Batcher[_Item, Any]] = {}
        # Batches compute on threads of their own, as many as may compute at once: a
        # model's batches never wait behind another model's large frames.
        self._batch_threads: ThreadPoolExecutor | None = None
        # Text operations (``Operation.off_loop``: tokenizing) compute on threads of their
        # own: a large batch of texts never holds a worker that a look-up or a frame needs.
        self._text_threads: ThreadPoolExecutor | None = None
        self._closed = False
        self._heavy_keys: set[Hashable] = set()  # the batchers of heavy operations
        # Over the batchers, not a method of this scheduler: no cycle keeps an unloaded
        # version (its tables) until the cyclic collector runs.
        self._admission = Admission(
            budget, max_queued_tokens=served.batch.max_queued_tokens,
            queued_tokens=functools.partial(_queued_light, self._batchers, self._heavy_keys),
            max_queued_work=served.batch.max_queued_nearest_flops,
            queued_work=functools.partial(
                _queued_work, self._batchers, self._heavy_keys,
                2 * served.d_model * served.vocab_size,
            ),
        )  # fmt: skip

    def queued_tokens(self) -> int:
        """Tokens (a heavy operation's: vectors) waiting in this model version's batchers."""
        return _queued_in(self._batchers)

    def queued_work(self) -> int:
        """The flops waiting in this version's heavy batchers (``_queued_work``)."""
        return _queued_work(self._batchers, self._heavy_keys,
                            2 * self.served.d_model * self.served.vocab_size)  # fmt: skip

    def admit(self, job: Job, on_release: Callable[[], None] | None = None) -> Ticket:
        """Room for ``job``, or ``Overloaded``; release the ticket once its answer is sent
        (``on_release`` is called then). A heavy job (``Costed``) is bounded by its work."""
        work = job.work if isinstance(job, Costed) else None
        return self._admission.admit(job.tokens, job.output_bytes, on_release, work=work)

    async def run(
        self,
        operation: Operation[Any, Any, Any],
        job: Job,
        deadline: float | None,
        frame: Callable[[Answer], F],
    ) -> F:
        """``job`` computed where the policy places it, its answer framed by ``frame``.

        ``deadline``: ``time.monotonic()`` after which nobody waits for the answer.
        Raises a ``core.errors.EmbedError`` for a job that fails.
        """
        if self._closed:  # the repository routes nothing here once closed; a bug if so
            raise Unavailable("this model version is unloaded")
        policy = self._policy
        if policy.batches or operation.heavy:
            # A batch holds one operation's jobs; embed's may mix dtypes (a batch computes
            # float32 rows and casts each job's own).
            key = operation.name
            batcher = self._batchers.get(key)
            idle = batcher is None or batcher.idle
        else:  # a backend that never batches has no batcher to ask
            key, idle = None, True
        placement = policy.place(
            job.tokens,
            job.output_bytes,
            batcher_idle=idle,
            heavy=operation.heavy,
            off_loop=operation.off_loop,
        )
        if placement is Placement.BATCH:
            return await self._batched(operation, job, key, deadline, frame)
        if deadlines.passed(deadline, time.monotonic()):
            # As the batcher does for the queued requests it takes: no compute for nobody.
            raise DeadlineExceeded("deadline passed before the look-up")
        if placement is Placement.INLINE:
            return self._alone(operation, job, frame)
        loop = asyncio.get_running_loop()
        workers = self._text_workers() if operation.off_loop else self._workers
        return await loop.run_in_executor(workers, self._alone, operation, job, frame)

    async def close(self) -> None:
        """Fail what is still queued, wait for the batches computing, let go."""
        self._closed = True
        for batcher in self._batchers.values():
            await batcher.close()
        for threads in (self._batch_threads, self._text_threads):
            if threads is not None:
                threads.shutdown(wait=False)
        self.served.backend.close()

    # --- the compute, for every placement

    def _alone(
        self, operation: Operation[Any, Any, Any], job: Job, frame: Callable[[Answer], F]
    ) -> F:
        """A compute of one request (a batch of one), its answer and its frame."""
        started = time.monotonic()
        (result,) = self._compute(operation, [job], job.tokens)
        compute_s = time.monotonic() - started
        timings = Timings(0.0, compute_s, 1, job.tokens)
        return frame(operation.answer(job, result, timings, self.served))

    async def _batched(
        self,
        operation: Operation[Any, Any, Any],
        job: Job,
        key: Hashable,
        deadline: float | None,
        frame: Callable[[Answer], F],
    ) -> F:
        """A compute in the batch of ``key``, and the frame (off the loop when large)."""
        batcher = self._batchers.get(key)
        if batcher is None:
            batcher = self._batchers[key] = self._new_batcher(operation.heavy)
            if operation.heavy:
                self._heavy_keys.add(key)
        batched = await batcher.submit((operation, job), job.tokens, deadline)
        timings = Timings(
            batched.queue_s, batched.compute_s, batched.batch_requests, batched.batch_tokens
        )
        answer = operation.answer(job, batched.result, timings, self.served)
        if self._policy.frames_inline(answer.nbytes):
            return frame(answer)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._workers, frame, answer)

    def _text_workers(self) -> ThreadPoolExecutor:
        if self._text_threads is None:
            self._text_threads = ThreadPoolExecutor(
                max_workers=TEXT_THREADS, thread_name_prefix=f"tokembed-text-{self.served.name}"
            )
        return self._text_threads

    def _new_batcher(self, heavy: bool) -> Batcher[_Item, Any]:
        """A batcher; a heavy operation's batches are bounded by rows (its vectors)."""
        limits = self.served.batch
        if self._batch_threads is None:
            self._batch_threads = ThreadPoolExecutor(
                max_workers=limits.max_concurrent_batches,
                thread_name_prefix=f"tokembed-batch-{self.served.name}",
            )
        return Batcher(
            self._run_batch,
            max_batch_tokens=limits.nearest_max_batch_rows if heavy else limits.max_batch_tokens,
            max_delay_s=limits.max_delay_s,
            max_concurrent_batches=limits.max_concurrent_batches,
            on_drop=self._report_drop,
        )

    async def _run_batch(self, items: list[_Item]) -> list[Any]:
        """A batch the batcher took: computed where the policy says, for its size."""
        operation = items[0][0]  # a batcher per operation
        jobs = [job for _, job in items]
        tokens = sum(job.tokens for job in jobs)
        output_bytes = sum(job.output_bytes for job in jobs)
        if self._policy.runs_inline(tokens, output_bytes, heavy=operation.heavy):
            return self._compute(operation, jobs, tokens)
        assert self._batch_threads is not None, "This is a bug."
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._batch_threads, self._compute, operation, jobs, tokens
        )

    def _compute(
        self, operation: Operation[Any, Any, Any], jobs: Sequence[Job], tokens: int
    ) -> list[Any]:
        """Every compute, whatever its placement: run, check, report once."""
        started = time.monotonic()
        try:
            results = operation.compute(self.served.backend, jobs)
        except EmbedError:
            raise
        except Exception as exc:
            logger.exception("look-up failed for a batch of %d request(s)", len(jobs))
            raise Internal(f"the look-up failed: {exc}") from exc
        if len(results) != len(jobs):
            raise Internal(f"this is a bug: the look-up gave {len(results)} results for "
                           f"{len(jobs)} requests")  # fmt: skip
        self._report_batch(len(jobs), tokens, time.monotonic() - started)
        return results

    # --- reports: every compute is reported here, once

    def _report_batch(self, requests: int, tokens: int, compute_s: float) -> None:
        if self._observer is not None:
            # A report (metrics) that fails must not fail the requests it reports.
            try:
                self._observer.batch_done(self.served.name, requests, tokens, compute_s)
            except Exception:
                logger.exception("batch report failed; this is a bug")

    def _report_drop(self, reason: str) -> None:
        if self._observer is not None:
            try:
                self._observer.dropped(self.served.name, reason)
            except Exception:
                logger.exception("drop report failed; this is a bug")
