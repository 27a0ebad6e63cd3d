"""One model's request path: validate, admit, look up where the policy says, answer.

Every request of every protocol goes through ``Engine.embed`` once, whatever its size or
dtype: validation (a bad request fails alone, before it could join a batch), admission,
then the look-up placed by the ``Policy`` (inline, off-loop or batched), reported as a
batch from one place, shaped into an ``Answer`` from one place, and handed to the
caller's ``encode`` (the protocol's framing), inline or on the worker thread that did
the look-up. A request placed inline completes without suspending.

It knows nothing of gRPC: errors are ``core.errors``; ``encode`` is the caller's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

from tokembed.export.model_dir import ModelDir
from tokembed.server.backends.base import Backend, Rows
from tokembed.server.core.admission import Admission, OutputBudget, Ticket
from tokembed.server.core.batcher import Batcher
from tokembed.server.core.errors import DeadlineExceeded, Internal
from tokembed.server.core.policy import Placement, Policy
from tokembed.server.core.types import Answer, Buffer, EmbedInput, Job, Timings, TokenIds
from tokembed.server.core.validation import Limits, validate

logger = logging.getLogger(__name__)

T = TypeVar("T")
_BatchItem = tuple[TokenIds, np.dtype]


class EngineObserver(Protocol):
    """What the engine reports (the metrics implement it)."""

    def batch_done(self, model: str, requests: int, tokens: int, compute_s: float) -> None: ...

    def dropped(self, model: str, reason: str) -> None: ...


@dataclass(frozen=True)
class BatchLimits:
    max_batch_tokens: int
    max_delay_s: float
    max_concurrent_batches: int
    max_queued_tokens: int


@dataclass(frozen=True)
class ServedModel:
    """What is served and how: what GetModelInfo and the logs report."""

    model: ModelDir
    backend: str  # "table" or "onnxruntime"
    execution_provider: str
    limits: Limits
    batch: BatchLimits

    @property
    def name(self) -> str:
        return self.model.manifest.name

    @property
    def version(self) -> str:
        return self.model.manifest.version


@dataclass(slots=True)
class Served(Generic[T]):
    """A served request: the caller's encoding of its answer, what the answer was (not
    its rows: those are in the payload, copied or not, and nowhere else), and the room it
    holds (release the ticket once the encoded answer has been sent)."""

    payload: T
    shape: tuple[int, ...]
    dtype: np.dtype
    tokens: int
    nbytes: int
    timings: Timings
    ticket: Ticket


class Engine:
    def __init__(
        self,
        model: ModelDir,
        backend: Backend,
        *,
        limits: Limits,
        batch: BatchLimits,
        policy: Policy,
        budget: OutputBudget,
        workers: Executor,
        observer: EngineObserver | None = None,
    ) -> None:
        """``workers``: threads for off-loop look-ups and encodes (shared by the models);
        ``budget``: the process's output bytes in flight (shared by the models)."""
        self.backend = backend
        self.served = ServedModel(
            model=model,
            backend=backend.kind,
            execution_provider=backend.execution_provider,
            limits=limits,
            batch=batch,
        )
        self.name = self.served.name
        self._limits = limits
        self._d_model = limits.d_model
        self._policy = policy
        self._workers = workers
        self._observer = observer
        self._batch_executor: ThreadPoolExecutor | None = None
        self._batcher: Batcher[_BatchItem, Rows] | None = None
        if policy.batches:
            self._batch_executor = ThreadPoolExecutor(
                max_workers=batch.max_concurrent_batches,
                thread_name_prefix=f"tokembed-batch-{self.name}",
            )
            self._batcher = Batcher(
                self._look_up_batch,
                self._batch_executor,
                max_batch_tokens=batch.max_batch_tokens,
                max_delay_s=batch.max_delay_s,
                max_concurrent_batches=batch.max_concurrent_batches,
                inline_max_tokens=policy.batch_inline_max_tokens(limits.d_model * 4),
                on_batch=self._report_batch,
                on_drop=self._report_drop,
            )
        self._admission = Admission(
            budget, max_queued_tokens=batch.max_queued_tokens, queued_tokens=self.queued_tokens
        )

    def queued_tokens(self) -> int:
        """Tokens waiting in this model's batcher (0 for a backend that does not batch)."""
        return 0 if self._batcher is None else self._batcher.queued_tokens

    async def embed(
        self, request: EmbedInput, deadline: float | None, encode: Callable[[Answer], T]
    ) -> Served[T]:
        """Serve one request; ``encode`` turns its answer into what the caller sends.

        Raises a ``core.errors.EmbedError`` for a request that fails (nothing is held
        then). ``deadline``: ``time.monotonic()`` after which nobody waits for the answer.
        """
        job = validate(request, self._limits)
        ticket = self._admission.admit(job.tokens, job.output_bytes)
        try:
            placement = self._policy.place(job)
            if placement is Placement.BATCH:
                payload, timings = await self._batched(job, deadline, encode)
            else:
                if deadline is not None and deadline <= time.monotonic():
                    # As the batcher does for queued requests: no look-up for nobody.
                    raise DeadlineExceeded("deadline passed before the look-up")
                if placement is Placement.INLINE:
                    payload, timings = self._look_up_alone(job, encode)
                else:
                    loop = asyncio.get_running_loop()
                    payload, timings = await loop.run_in_executor(
                        self._workers, self._look_up_alone, job, encode
                    )
        except BaseException:
            ticket.release()
            raise
        # Nothing but the payload refers to the answer's rows by now (the functions that
        # held them have returned): a large answer is not alive twice while it is sent.
        return Served(
            payload, job.answer_shape(self._d_model), job.output_dtype, job.tokens,
            job.output_bytes, timings, ticket,
        )  # fmt: skip

    async def close(self) -> None:
        """Fail what is still queued, wait for the batches computing, let go."""
        if self._batcher is not None:
            await self._batcher.close()
        if self._batch_executor is not None:
            self._batch_executor.shutdown(wait=False)
        self.backend.close()

    # --- the look-up, for every placement

    def _look_up_alone(self, job: Job, encode: Callable[[Answer], T]) -> tuple[T, Timings]:
        """A look-up of one request (a batch of one), and its encode."""
        started = time.monotonic()
        try:
            rows = self.backend.look_up(job.ids, job.output_dtype)
        except Exception as exc:
            logger.exception("look-up failed for a batch of 1 request")
            raise Internal(f"the look-up failed: {exc}") from exc
        compute_s = time.monotonic() - started
        self._report_batch(1, job.tokens, compute_s)
        timings = Timings(0.0, compute_s, 1, job.tokens)
        return encode(self._answer(job, rows, timings)), timings

    async def _batched(
        self, job: Job, deadline: float | None, encode: Callable[[Answer], T]
    ) -> tuple[T, Timings]:
        """A look-up in the model's batch, and its encode (off the loop when large)."""
        assert self._batcher is not None, "This is a bug."
        batched = await self._batcher.submit((job.ids, job.output_dtype), job.tokens, deadline)
        timings = Timings(
            batched.queue_s, batched.compute_s, batched.batch_requests, batched.batch_tokens
        )
        answer = self._answer(job, batched.result, timings)
        if self._policy.encodes_inline(answer.nbytes):
            return encode(answer), timings
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._workers, encode, answer), timings

    def _look_up_batch(self, items: list[_BatchItem]) -> list[Rows]:
        """The batcher's compute: the backend's look-up of several requests at once."""
        return self.backend.look_up_batch(items)

    def _answer(self, job: Job, rows: Rows, timings: Timings) -> Answer:
        """The answer's shape and pieces: the rows, with padding rows after each sequence
        of a padded ragged answer."""
        if len(rows) != job.tokens:
            raise Internal(f"this is a bug: the look-up gave {len(rows)} rows for {job.tokens} ids")
        if job.padded:
            assert job.lengths is not None
            pad = self.backend.pad_row(job.output_dtype)
            pieces: list[Buffer] = []
            offset = 0
            for length in job.lengths:
                pieces += rows.pieces(offset, offset + length)
                pieces += [pad] * (job.seq_len - length)
                offset += length
        else:
            pieces = rows.pieces(0, job.tokens)
        return Answer(
            job.answer_shape(self._d_model), job.output_dtype, pieces, job.lengths, timings,
            job.tokens, job.output_bytes,
        )  # fmt: skip

    # --- reports: every look-up's batch is reported here, once

    def _report_batch(self, requests: int, tokens: int, compute_s: float) -> None:
        if self._observer is not None:
            # A report (metrics) that fails must not fail the request it reports.
            try:
                self._observer.batch_done(self.name, requests, tokens, compute_s)
            except Exception:
                logger.exception("batch report failed; this is a bug")

    def _report_drop(self, reason: str) -> None:
        if self._observer is not None:
            try:
                self._observer.dropped(self.name, reason)
            except Exception:
                logger.exception("drop report failed; this is a bug")
