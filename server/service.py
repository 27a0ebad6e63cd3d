"""The data plane: validate, admit, batch, look up, shape the answer.

One ``EmbeddingService`` serves one loaded model. It knows the domain objects, the
batcher and the runtime; it knows nothing of gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np

from tokembed.export.model_dir import ModelDir
from tokembed.server.admission import Admission, Ticket
from tokembed.server.batcher import Batcher, BatchObserver, BatchResult, Compute
from tokembed.server.domain import FLAT, AnswerInto, EmbedInput, EmbedJob, EmbedOutput, Timings
from tokembed.server.errors import DeadlineExceeded, Internal, Overloaded, Unavailable
from tokembed.server.gather import SPLIT_GATHER_MIN_BYTES, GatherHelper, gather_into
from tokembed.server.row_bytes import RowBytes, int64_values
from tokembed.server.settings import Settings
from tokembed.server.validation import Limits, validate

logger = logging.getLogger(__name__)

T = TypeVar("T")

_INT64 = np.dtype("<i8")
_FLOAT32_ITEMSIZE = 4

# Below this, copying or encoding on the event loop is cheaper than a thread hop.
OFFLOAD_MIN_BYTES = 1 << 20


class Offloader:
    """Runs CPU-heavy steps (casts, copies, encodes) off the event loop when they are big."""

    def __init__(self, executor: Executor, min_bytes: int = OFFLOAD_MIN_BYTES) -> None:
        self._executor = executor
        self._min_bytes = min_bytes

    async def run(self, nbytes: int, fn: Callable[..., T], *args: object) -> T:
        if nbytes < self._min_bytes:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)


class PlainAnswer(NamedTuple):
    """``EmbeddingService.embed_plain``'s answer: float32 rows ``[B, S, D]`` as pieces of
    bytes that, joined in order, are the array's bytes (no array is made: see
    ``RowBytes``); the room it holds until sent."""

    pieces: Sequence[memoryview]
    shape: tuple[int, int, int]
    timings: Timings
    ticket: Ticket


@dataclass(frozen=True)
class ServedModel:
    """What GetModelInfo reports."""

    model: ModelDir
    execution_provider: str
    limits: Limits


class EmbeddingService:
    def __init__(
        self,
        model: ModelDir,
        compute: Compute,
        execution_provider: str,
        settings: Settings,
        *,
        compute_executor: Executor | None = None,
        observer: BatchObserver | None = None,
        to_float16: Callable[[np.ndarray], np.ndarray] | None = None,
        pad_row: np.ndarray | None = None,
        float16_table: np.ndarray | None = None,
        float32_table: np.ndarray | None = None,
        rows_per_request: bool = False,
    ) -> None:
        manifest = model.manifest
        self.settings = settings
        self.info = ServedModel(
            model=model,
            execution_provider=execution_provider,
            limits=Limits(
                vocab_size=manifest.vocab_size,
                d_model=manifest.d_model,
                model_name=manifest.name,
                max_tokens_per_request=settings.max_tokens_per_request,
                max_output_bytes_per_request=settings.max_output_bytes_per_request,
            ),
        )
        self._to_float16 = to_float16 or (lambda rows: rows.astype(np.float16))
        self._own_executor = compute_executor is None
        self._compute_executor = compute_executor or ThreadPoolExecutor(
            max_workers=settings.max_concurrent_batches, thread_name_prefix="tokembed-compute"
        )
        self.offloader = Offloader(
            ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokembed-encode")
        )
        # Takes half of each large in-place gather (see SPLIT_GATHER_MIN_BYTES).
        self._gather_helper = GatherHelper()
        self.batcher = Batcher(
            compute,
            self._compute_executor,
            max_batch_tokens=settings.max_batch_tokens,
            max_delay_s=settings.max_delay_s,
            max_concurrent_batches=settings.max_concurrent_batches,
            inline_max_tokens=settings.inline_compute_max_tokens,
            observer=observer,
            rows_per_request=rows_per_request,
        )
        self.admission = Admission(
            max_queued_tokens=settings.max_queued_tokens,
            max_inflight_output_bytes=settings.max_inflight_output_bytes,
            queued_tokens=lambda: self.batcher.queued_tokens,
        )
        # Padded positions of ragged answers hold this row (see LoadedModel.pad_row).
        self._pad_row = (
            pad_row if pad_row is not None else np.zeros(manifest.d_model, dtype=np.float32)
        )
        # E * scale for every id, rounded to float16 once at load (see LoadedModel).
        self._float16_table = float16_table
        # The same in float32, when the runtime answers from one (it is the runtime's).
        self._float32_table = float32_table
        # Its rows as bytes, where embed_plain joins tiny answers from.
        self._float32_rows = None if float32_table is None else RowBytes(float32_table)
        self.draining = False
        # What embed_plain answers: at most this many tokens (within the request limits,
        # few enough to look up inline, an answer below the offload size).
        row_bytes = manifest.d_model * _FLOAT32_ITEMSIZE
        self._plain_max_tokens = min(
            settings.inline_compute_max_tokens,
            settings.max_tokens_per_request,
            settings.max_output_bytes_per_request // row_bytes,
            (OFFLOAD_MIN_BYTES - 1) // row_bytes,  # embed() gathers those in place
        )

    async def embed(
        self, request: EmbedInput, deadline: float | None, answer_into: AnswerInto | None = None
    ) -> tuple[EmbedOutput, Ticket]:
        """Serve one request. The caller releases the ticket once the answer is sent.

        ``answer_into``: where the caller would like the answer written, if it can take
        it in place; used for large answers gathered from a row table.
        """
        if self.draining:
            raise Unavailable("the server is draining; retry on another replica")
        job = validate(request, self.info.limits)
        ticket = self.admission.admit(job.tokens, job.output_bytes)
        try:
            table = None if answer_into is None else self._in_place_table(job)
            if table is not None:
                assert answer_into is not None
                if deadline is not None and deadline <= time.monotonic():
                    # As the batcher does for queued requests: no look-up for nobody.
                    raise DeadlineExceeded("deadline passed before the look-up")
                shape = _answer_shape(job, table.shape[1])
                known = Timings(
                    queue_s=0.0, compute_s=0.0, batch_requests=1, batch_tokens=job.tokens
                )
                hidden = answer_into(shape, job.output_dtype, job.lengths, known)
                helper = self._gather_helper if job.output_bytes >= SPLIT_GATHER_MIN_BYTES else None
                result = await self.offloader.run(
                    job.output_bytes, gather_into, table, job, hidden, self._pad_row, helper
                )
                if table is self._float32_table:
                    # float32 look-ups all count as batches (this one of one); float16
                    # answers from their table never do (docs/metrics.md).
                    self.batcher.report_batch(1, job.tokens, result.compute_s)
            else:
                if self._float16_table is not None and job.output_dtype == np.float16:
                    result = await self.offloader.run(job.output_bytes, self._float16_rows, job)
                else:
                    result = await self.batcher.submit(job.ids, deadline)
                hidden = await self.offloader.run(job.output_bytes, self._shape_answer, job, result)
        except BaseException:
            ticket.release()
            raise
        timings = Timings(
            queue_s=result.queue_s,
            compute_s=result.compute_s,
            batch_requests=result.batch_requests,
            batch_tokens=result.batch_tokens,
        )
        return EmbedOutput(hidden_states=hidden, lengths=job.lengths, timings=timings), ticket

    def embed_plain(
        self, ids: bytes, batch: int, seq_len: int, deadline: float | None
    ) -> PlainAnswer | None:
        """Serve the commonest request at once, or return None having done nothing.

        The commonest request: int64 ids ``[batch, seq_len]`` (their bytes), a float32
        answer under ``OFFLOAD_MIN_BYTES``, few enough tokens to look up on the event
        loop, valid, admitted, and its deadline not passed. It gets what :meth:`embed`
        would give it (the same rows, timings, batch and metric updates) without the
        domain objects and awaits every other request goes through: for a tiny request
        they were a third of its handler's time, measured live. With a float32 table its
        rows are slices of the table's bytes (see ``RowBytes``), reported as a batch of
        one, as :meth:`embed` reports the answers it gathers from the table itself: a
        gather from memory gains nothing from company. Without one, it is looked up
        alone if the batcher is idle, and queues (None) if not. Anything else, and every
        request to refuse, gets None: :meth:`embed` then serves it or says what is
        wrong. The caller releases the ticket once the answer is sent.
        """
        tokens = batch * seq_len
        if (
            self.draining
            or batch <= 0
            or seq_len <= 0
            or tokens > self._plain_max_tokens
            or len(ids) != tokens * _INT64.itemsize
        ):
            return None
        values = int64_values(ids)
        limits = self.info.limits
        # validation.within_vocabulary's rule, on the ints at hand.
        if min(values) < 0 or max(values) >= limits.vocab_size:
            return None
        if deadline is not None and deadline <= time.monotonic():
            return None  # embed() refuses it (DeadlineExceeded)
        d_model = limits.d_model
        try:
            ticket = self.admission.admit(tokens, tokens * d_model * _FLOAT32_ITEMSIZE)
        except Overloaded:
            return None  # embed() refuses it the same way, and counts the refusal
        try:
            table = self._float32_rows
            if table is not None:
                started = time.monotonic()
                pieces: Sequence[memoryview] = table.rows(values)
                compute_s = time.monotonic() - started
                self.batcher.report_batch(1, tokens, compute_s)
            else:
                result = self.batcher.try_alone_now(np.frombuffer(ids, dtype=_INT64), deadline)
                if result is None:  # it must queue: embed() does that
                    ticket.release()
                    return None
                rows = np.ascontiguousarray(result.rows, dtype=np.float32)
                if rows.shape != (tokens, d_model):
                    raise Internal(f"the look-up gave rows of shape {rows.shape} for {tokens} ids")
                pieces, compute_s = [rows.data], result.compute_s
        except BaseException:
            ticket.release()
            raise
        timings = Timings(queue_s=0.0, compute_s=compute_s, batch_requests=1, batch_tokens=tokens)
        return PlainAnswer(pieces, (batch, seq_len, d_model), timings, ticket)

    def _in_place_table(self, job: EmbedJob) -> np.ndarray | None:
        """The row table to gather a job's answer from straight into the caller's array:
        large answers only (below, the copy costs less than the thread hop that is
        saved). Like float16 answers, no batch: a gather from memory gains nothing from
        company."""
        if job.output_bytes < OFFLOAD_MIN_BYTES:
            return None
        return self._float16_table if job.output_dtype == np.float16 else self._float32_table

    def _float16_rows(self, job: EmbedJob) -> BatchResult:
        """float16 answers come straight from the float16 table: half the bytes to gather
        and no cast per request, bit-identical to casting the look-up's float32 rows.
        No batch: a gather from memory gains nothing from company."""
        assert self._float16_table is not None
        started = time.monotonic()
        rows = self._float16_table.take(job.ids, axis=0)
        return BatchResult(rows, 0.0, time.monotonic() - started, 1, job.tokens)

    def _shape_answer(self, job: EmbedJob, result: BatchResult) -> np.ndarray:
        rows = result.rows
        d_model = rows.shape[1]
        if not job.ragged:
            return self._as_dtype(rows, job.output_dtype).reshape(job.batch, job.seq_len, d_model)
        if job.layout == FLAT:
            return self._as_dtype(rows, job.output_dtype)
        assert job.lengths is not None
        rows = self._as_dtype(rows, job.output_dtype)
        padded = np.empty((job.batch, job.seq_len, d_model), dtype=job.output_dtype)
        pad_row = self._pad_row.astype(job.output_dtype)
        offset = 0
        for index, length in enumerate(job.lengths):
            padded[index, :length] = rows[offset : offset + length]
            padded[index, length:] = pad_row
            offset += length
        return padded

    def _as_dtype(self, rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
        # float32 answers keep the view into the batch's output (no copy); float16 ones
        # are a fresh, contiguous array.
        if rows.dtype == dtype:
            return np.ascontiguousarray(rows)
        return self._to_float16(np.ascontiguousarray(rows))

    async def close(self) -> None:
        await self.batcher.close()
        self._gather_helper.shutdown()
        if self._own_executor:
            self._compute_executor.shutdown(wait=False)


def _answer_shape(job: EmbedJob, d_model: int) -> tuple[int, ...]:
    if job.ragged and job.layout == FLAT:
        return (job.tokens, d_model)
    return (job.batch, job.seq_len, d_model)
