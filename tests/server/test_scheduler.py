"""``Scheduler``: one model version's compute (admit, place, batch, run, report, answer,
frame), built by hand around the real backends of the small model: the table backend (as
the server loads it) and the onnxruntime backend (``float32_table_max_bytes=0``), with
the embed operation validating each request first, as the data plane does.

Proved here:
- one path: every placement (inline, off-loop, batched alone, batched in a queue) gives
  the same bytes for the same request, bit-identical to ``E[id] * sqrt(D)``, for
  rectangular, ragged padded and ragged flat requests, float32 and float16, int64 and
  int32 ids; each placement is checked to have happened where the policy says (the
  thread of the compute and of the frame);
- a request placed inline completes without suspending (its coroutine ends on its first
  step, with no event loop at all) and is framed on the calling thread; a large one is
  framed on a ``workers`` thread;
- a small request beside a busy batcher joins the batch rather than computing alone;
- a token's vector is the same alone or inside a large mixed batch;
- computes are reported from one place, once per compute, with the right counts;
- admission: ``Overloaded`` past the queue bound and past the budget shared by the
  models; a ticket holds its room until released;
- a passed deadline fails before any compute; a failing report (of a batch, or of a
  drop) fails no request and strands none; a compute that raises is ``Internal``, and
  so is a backend that loses rows, naming the counts; ``close`` fails what is queued
  with ``Unavailable`` and lets the computing batch finish;
- a batch is computed on the loop only under the inline byte bound too, not just the
  token bound.

What the data plane adds around it (routing, validation's refusals, the room held until
the answer is sent and given back on failure) is tests/server/test_dataplane.py's.

Computes are held at a gate (``support.backends``) wherever a test needs
requests to queue: nothing here waits on time.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from tokembed.server.backends.base import Backend
from tokembed.server.core.admission import OutputBudget, Ticket
from tokembed.server.core.dtypes import OUTPUT_DTYPES
from tokembed.server.core.errors import (
    DeadlineExceeded,
    Internal,
    Overloaded,
    Unavailable,
)
from tokembed.server.core.operations.embed import EMBED, FLAT, PADDED, EmbedInput, EmbedJob
from tokembed.server.core.policy import INLINE_MAX_BYTES, Policy
from tokembed.server.core.scheduler import Scheduler
from tokembed.server.core.served import BatchLimits, Limits, ServedModel
from tokembed.server.core.types import Answer
from tokembed.server.models.loading import LoadedModel, load_model
from tokembed.server.process.settings import Settings

from support.backends import Gate, HookedBackend, entered, failing
from support.fixtures import SMALL_D, SMALL_PAD, SMALL_V

T = TypeVar("T")

WORKERS = "test-workers"  # the thread name prefix of the schedulers' ``workers``
BATCH_THREADS = "tokembed-batch-"  # the scheduler's own batch threads
INLINE_TOKENS = 256  # the server's default inline_compute_max_tokens
MAX_TOKENS = 65536
# Policies that force a placement whatever the size, to put one request everywhere.
NEVER_INLINE = {"inline_max_tokens": 0, "inline_max_bytes": 0}
ALWAYS_INLINE = {"inline_max_tokens": 1 << 30, "inline_max_bytes": 1 << 40}


# --- what the scheduler is given, and what it reports


class Reports:
    """The scheduler's observer: every batch and every drop it is told of."""

    def __init__(self, *, fail: bool = False) -> None:
        self.fail = fail
        self.batches: list[tuple[str, int, int]] = []  # (model, requests, tokens)
        self.drops: list[tuple[str, str]] = []  # (model, reason)

    def batch_done(self, model: str, requests: int, tokens: int, compute_s: float) -> None:
        assert compute_s >= 0
        self.batches.append((model, requests, tokens))
        if self.fail:
            raise RuntimeError("the metrics broke")

    def dropped(self, model: str, reason: str) -> None:
        self.drops.append((model, reason))


@dataclass
class Framed:
    """What a frame made of an answer: its bytes joined (what a response carries after its
    header), the answer, and the thread the frame ran on."""

    payload: bytes
    answer: Answer
    thread: str


class Frame:
    """The caller's ``frame``: records every answer it frames."""

    def __init__(self) -> None:
        self.framed: list[Framed] = []

    def __call__(self, answer: Answer) -> Framed:
        framed = Framed(b"".join(answer.pieces), answer, threading.current_thread().name)
        self.framed.append(framed)
        return framed

    @property
    def threads(self) -> list[str]:
        return [framed.thread for framed in self.framed]


@dataclass
class Served:
    """One request served: its frame, and the ticket that holds its room until released."""

    framed: Framed
    ticket: Ticket

    @property
    def payload(self) -> bytes:
        return self.framed.payload

    @property
    def answer(self) -> Answer:
        return self.framed.answer


def validated(scheduler: Scheduler, request: EmbedInput) -> EmbedJob:
    return EMBED.validate(request, scheduler.served)


async def embed(
    scheduler: Scheduler,
    request: EmbedInput,
    deadline: float | None = None,
    frame: Frame | None = None,
) -> Served:
    """The request validated, admitted and run, as the data plane does: a failed run gives
    its room back."""
    job = validated(scheduler, request)
    ticket = scheduler.admit(job)
    try:
        framed = await scheduler.run(EMBED, job, deadline, frame or Frame())
    except BaseException:
        ticket.release()
        raise
    return Served(framed, ticket)


# --- requests and the answers expected of them


def rectangular(ids: np.ndarray, output: str = "float32") -> EmbedInput:
    return EmbedInput(ids.dtype.name, ids.shape, ids.tobytes(), (), output, PADDED)


def ragged(
    ids: np.ndarray, lengths: Sequence[int], output: str = "float32", layout: str = PADDED
) -> EmbedInput:
    return EmbedInput(ids.dtype.name, ids.shape, ids.tobytes(), tuple(lengths), output, layout)


def token_ids(count: int, dtype: str, seed: int = 0) -> np.ndarray:
    """``count`` ids, the first ones at the vocabulary's edges (the last id, the padding id)."""
    ids = np.random.default_rng(seed).integers(0, SMALL_V, count)
    ids[: min(count, 2)] = [SMALL_V - 1, SMALL_PAD][: min(count, 2)]
    return ids.astype(dtype)


def reference(request: EmbedInput, rows: np.ndarray) -> bytes:
    """The answer's bytes, computed from the reference rows alone."""
    ids = np.frombuffer(request.data, dtype=np.dtype(request.ids_dtype).newbyteorder("<"))
    table = rows.astype(request.output_dtype)
    picked = table[ids.astype(np.int64)]
    if not request.lengths or request.layout == FLAT:
        return picked.tobytes()
    # Padded: each sequence, then the padding id's row up to the longest.
    longest = max(request.lengths)
    pieces = []
    for sequence in np.split(picked, np.cumsum(request.lengths)[:-1]):
        pieces += [sequence, np.repeat(table[[SMALL_PAD]], longest - len(sequence), axis=0)]
    return np.concatenate(pieces).tobytes()


def answer_shape(request: EmbedInput) -> tuple[int, ...]:
    if not request.lengths:
        return (*request.shape, SMALL_D)
    if request.layout == FLAT:
        return (sum(request.lengths), SMALL_D)
    return (len(request.lengths), max(request.lengths), SMALL_D)


# Every form a request takes, at two sizes: tiny (8 tokens, inline under the server's
# policy) and large (8192 tokens: 2 MiB in float32, 1 MiB in float16, so over
# INLINE_MAX_BYTES either way, and over the inline token bound).
SIZES = {"tiny": (8, (3, 1, 4)), "large": (8192, (4096, 1, 4095))}
FORMS: dict[str, Callable[[int, tuple[int, ...]], EmbedInput]] = {
    "rect-int64-float32": lambda n, _: rectangular(token_ids(n, "<i8").reshape(2, -1)),
    "rect-int32-float16": lambda n, _: rectangular(
        token_ids(n, "<i4", 1).reshape(2, -1), "float16"
    ),
    "padded-int64-float16": lambda n, lengths: ragged(token_ids(n, "<i8", 2), lengths, "float16"),
    "padded-int32-float32": lambda n, lengths: ragged(token_ids(n, "<i4", 3), lengths),
    "flat-int64-float32": lambda n, lengths: ragged(token_ids(n, "<i8", 4), lengths, layout=FLAT),
    "flat-int32-float16": lambda n, lengths: ragged(
        token_ids(n, "<i4", 5), lengths, "float16", FLAT
    ),
}


def request_of(form: str, size: str) -> EmbedInput:
    tokens, lengths = SIZES[size]
    return FORMS[form](tokens, lengths)


def tokens_of(request: EmbedInput) -> int:
    return len(request.data) // np.dtype(request.ids_dtype).itemsize


def assert_large(request: EmbedInput) -> None:
    """A "large" request really is past both inline bounds (or the test proves nothing)."""
    rows = int(np.prod(answer_shape(request)[:-1]))
    assert rows * SMALL_D * np.dtype(request.output_dtype).itemsize >= INLINE_MAX_BYTES
    assert tokens_of(request) > INLINE_TOKENS


# --- schedulers


@pytest.fixture(scope="module")
def ort_loaded(small_model_dir: Path) -> Iterator[LoadedModel]:
    """The small model on the onnxruntime backend, loaded as the server loads it."""
    loaded = load_model(small_model_dir, Settings(float32_table_max_bytes=0))
    assert loaded.backend.kind == "onnxruntime" and loaded.backend.batches
    yield loaded
    loaded.backend.close()


@pytest.fixture(scope="module")
def backends(small_loaded: LoadedModel, ort_loaded: LoadedModel) -> dict[str, Backend]:
    assert small_loaded.backend.kind == "table" and not small_loaded.backend.batches
    return {"table": small_loaded.backend, "onnxruntime": ort_loaded.backend}


@pytest.fixture
def workers() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(2, thread_name_prefix=WORKERS)
    yield pool
    pool.shutdown()


@pytest.fixture
def make_scheduler(
    small_loaded: LoadedModel, workers: ThreadPoolExecutor
) -> Callable[..., Scheduler]:
    """``make_scheduler(backend, ...)``: a scheduler as the server builds one (its policy
    from the backend, the server's default inline bound), each part replaceable."""

    def make(
        backend: Backend,
        *,
        budget: OutputBudget | None = None,
        observer: Reports | None = None,
        max_queued_tokens: int = 1 << 20,
        **policy: Any,
    ) -> Scheduler:
        policy.setdefault("inline_max_tokens", INLINE_TOKENS)
        served = ServedModel(
            small_loaded.model,
            backend,
            Limits(max_tokens_per_request=MAX_TOKENS, max_output_bytes_per_request=1 << 30),
            BatchLimits(
                max_batch_tokens=16384,
                max_delay_s=0.002,
                max_concurrent_batches=1,
                max_queued_tokens=max_queued_tokens,
            ),
        )
        return Scheduler(
            served,
            policy=Policy(batches=backend.batches, **policy),
            budget=budget if budget is not None else OutputBudget(1 << 30),
            workers=workers,
            observer=observer,
        )

    return make


def run(body: Coroutine[Any, Any, T], *schedulers: Scheduler) -> T:
    """Run ``body`` in a fresh event loop, then close ``schedulers`` in that same loop."""

    async def main() -> T:
        tasks: list[asyncio.Task[Any]] = []

        def recorded(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
            task = asyncio.Task(coro, loop=loop, **kwargs)
            tasks.append(task)
            return task

        asyncio.get_running_loop().set_task_factory(recorded)
        try:
            return await body
        finally:
            try:
                for scheduler in schedulers:
                    await scheduler.close()
            finally:
                # Collect what a failing test left behind. A request's exception never
                # retrieved is logged later, from the garbage collector; seen here in the
                # middle of pytest's report of the failure, it crashed the whole session
                # (CPython 3.11: "SystemError: AST constructor recursion depth mismatch")
                # instead of failing one test.
                for task in tasks:
                    task.cancel()  # nothing for those done
                await asyncio.gather(*tasks, return_exceptions=True)

    return asyncio.run(main())


async def until(condition: Callable[[], bool], waiting: Sequence[asyncio.Future[Any]]) -> None:
    """Give the loop turns until ``condition`` holds (a request queues within a few),
    while every request in ``waiting`` is still waiting: one that ended early (refused,
    failed) is the failure to report, not a condition that never came true."""
    for _ in range(10_000):
        ended = [task for task in waiting if task.done()]
        if ended:
            raise AssertionError(f"a request meant to wait ended: {ended[0]!r}")
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


def thread_kind(name: str) -> str:
    if name == threading.current_thread().name:
        return "loop"
    if name.startswith(WORKERS):
        return "workers"
    if name.startswith(BATCH_THREADS):
        return "batch"
    raise AssertionError(f"ran on an unexpected thread {name!r}")


# --- one path


# Each placement: the backend, the policy that forces it, and where the compute and the
# frame must run (loop: the caller's thread; workers: the shared pool; batch: the
# scheduler's batch thread), for a tiny and for a large request. "batched-alone" is a
# batching backend's request beside an idle batcher: computed at once, alone.
PLACEMENTS: dict[str, dict[str, tuple[str, dict[str, int], str, str]]] = {
    "tiny": {
        "inline": ("table", {}, "loop", "loop"),
        "off-loop": ("table", NEVER_INLINE, "workers", "workers"),
        "batched-alone": ("onnxruntime", {}, "loop", "loop"),
        "batched-queued": ("onnxruntime", NEVER_INLINE, "batch", "workers"),
    },
    "large": {
        "inline": ("table", ALWAYS_INLINE, "loop", "loop"),
        "off-loop": ("table", {}, "workers", "workers"),
        "batched-alone": ("onnxruntime", ALWAYS_INLINE, "loop", "loop"),
        "batched-queued": ("onnxruntime", {}, "batch", "workers"),
    },
}


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("form", list(FORMS))
def test_every_placement_gives_the_reference_bytes(
    make_scheduler: Callable[..., Scheduler],
    backends: dict[str, Backend],
    small_rows: np.ndarray,
    form: str,
    size: str,
) -> None:
    request = request_of(form, size)
    if size == "large":
        assert_large(request)  # with the server's own policy, it must leave the loop
    want = reference(request, small_rows)
    for placement, (kind, policy, compute_on, frame_on) in PLACEMENTS[size].items():
        spy, frame, budget = HookedBackend(backends[kind]), Frame(), OutputBudget(1 << 30)
        scheduler = make_scheduler(spy, budget=budget, **policy)
        served = run(embed(scheduler, request, None, frame), scheduler)
        where = f"{form} {size} {placement}"

        assert served.payload == want, where
        (framed,) = frame.framed
        answer = served.answer
        assert framed.answer is answer, where
        assert answer.shape == answer_shape(request), where
        assert answer.dtype is OUTPUT_DTYPES[request.output_dtype], where
        assert answer.lengths == (request.lengths or None), where
        assert answer.nbytes == len(want) and answer.tokens == tokens_of(request), where
        assert (answer.model_name, answer.model_version) == ("small", "1"), where
        assert (answer.timings.batch_requests, answer.timings.batch_tokens) == (1, answer.tokens)
        # ...and it ran where this placement runs, with one compute.
        assert [(thread_kind(c.thread), c.counts) for c in spy.calls] == [
            (compute_on, [answer.tokens])
        ], where
        assert [thread_kind(t) for t in frame.threads] == [frame_on], where
        # Served, not yet sent: the room is held until the ticket is released.
        assert budget.inflight_bytes == answer.nbytes, where
        served.ticket.release()
        assert budget.inflight_bytes == 0, where


@pytest.mark.parametrize("kind", ["table", "onnxruntime"])
def test_an_inline_request_completes_without_suspending_on_the_calling_thread(
    make_scheduler: Callable[..., Scheduler],
    backends: dict[str, Backend],
    small_rows: np.ndarray,
    kind: str,
) -> None:
    request = request_of("padded-int32-float32", "tiny")
    spy, frame = HookedBackend(backends[kind]), Frame()
    scheduler = make_scheduler(spy)
    job = validated(scheduler, request)
    ticket = scheduler.admit(job)
    # No event loop at all: a first step that suspended (awaited a thread, a future, a
    # batch) would hand back what it awaits instead of finishing.
    coroutine = scheduler.run(EMBED, job, None, frame)
    with pytest.raises(StopIteration) as finished:
        coroutine.send(None)
    framed: Framed = finished.value.value
    assert framed.payload == reference(request, small_rows)
    here = threading.current_thread().name
    assert frame.threads == [here]
    assert [c.thread for c in spy.calls] == [here]
    ticket.release()
    asyncio.run(scheduler.close())


def test_only_a_request_that_leaves_the_loop_lets_other_tasks_run(
    make_scheduler: Callable[..., Scheduler], backends: dict[str, Backend], small_rows: np.ndarray
) -> None:
    scheduler = make_scheduler(backends["table"])
    turns: list[str] = []

    async def bystander(label: str) -> None:
        turns.append(label)

    async def body() -> None:
        for size in ("tiny", "large"):
            request = request_of("rect-int64-float32", size)
            task = asyncio.ensure_future(bystander(size))
            frame = Frame()
            served = await embed(scheduler, request, None, frame)
            # A tiny request ran to its end before the loop could start anyone else.
            assert (size in turns) is (size == "large")
            assert thread_kind(frame.threads[0]) == ("loop" if size == "tiny" else "workers")
            assert served.payload == reference(request, small_rows)
            served.ticket.release()
            await task

    run(body(), scheduler)


# --- batches


def test_a_small_request_beside_a_busy_batcher_joins_the_next_batch(
    make_scheduler: Callable[..., Scheduler], ort_loaded: LoadedModel, small_rows: np.ndarray
) -> None:
    """The policy's idle rule followed: while a batch computes, small requests that would
    have computed inline alone queue instead, and go together as one batch, small enough
    to be computed (and framed) on the loop."""
    gated = HookedBackend(ort_loaded.backend, Gate(open=False))
    reports = Reports()
    # Only the first, large request leaves the loop (held at the gate there).
    scheduler = make_scheduler(gated, observer=reports)
    large = request_of("rect-int64-float32", "large")
    small = [rectangular(np.array([[n, n + 1]], "<i8")) for n in (11, 21, 31)]

    async def body() -> list[Served]:
        try:
            first = asyncio.ensure_future(embed(scheduler, large))
            await entered(gated)
            frames = [Frame() for _ in small]
            tasks = [
                asyncio.ensure_future(embed(scheduler, request, None, frame))
                for request, frame in zip(small, frames, strict=True)
            ]
            await until(lambda: scheduler.queued_tokens() == 6, [first, *tasks])
            assert len(gated.calls) == 1  # none of them computed beside the busy batch
        finally:
            gated.gate.open()
        served = await asyncio.gather(*tasks)
        (await first).ticket.release()
        here = threading.current_thread().name
        assert [f.threads for f in frames] == [[here]] * 3  # small answers: framed inline
        return served

    served = run(body(), scheduler)
    assert [len(c.ids) for c in gated.calls] == [8192, 6]
    assert reports.batches == [("small", 1, 8192), ("small", 3, 6)]
    for request, each in zip(small, served, strict=True):
        assert each.payload == reference(request, small_rows)
        assert (each.answer.timings.batch_requests, each.answer.timings.batch_tokens) == (3, 6)
        each.ticket.release()


def test_a_token_s_vector_is_the_same_alone_or_in_a_large_mixed_batch(
    make_scheduler: Callable[..., Scheduler], ort_loaded: LoadedModel, small_rows: np.ndarray
) -> None:
    gated = HookedBackend(ort_loaded.backend, Gate(open=False))
    reports, budget = Reports(), OutputBudget(1 << 30)
    # No compute on the loop (one held at the gate would hold the loop); answers framed
    # where the server's byte bound says.
    scheduler = make_scheduler(gated, observer=reports, budget=budget, inline_max_tokens=0)
    # Every form at two sizes, one answer of INLINE_MAX_BYTES (framed off-loop, the
    # others on the loop), and one id alone in both dtypes; the ids repeat across
    # requests. Sized to fit one batch.
    mixed = [request_of(form, "tiny") for form in FORMS]
    mixed += [FORMS[form](1500, (700, 1, 799)) for form in FORMS if form != "rect-int32-float16"]
    mixed += [request_of("rect-int32-float16", "large")]
    mixed += [rectangular(np.array([[7]], "<i8")), rectangular(np.array([[7]], "<i4"), "float16")]
    total = sum(tokens_of(r) for r in mixed)
    assert total <= 16384  # max_batch_tokens: one batch

    async def body() -> tuple[list[Served], list[Served]]:
        try:
            # The first request holds the backend; the others queue behind it.
            first = asyncio.ensure_future(embed(scheduler, mixed[0]))
            await entered(gated)
            tasks = [asyncio.ensure_future(embed(scheduler, r)) for r in mixed]
            await until(lambda: scheduler.queued_tokens() == total, [first, *tasks])
        finally:
            gated.gate.open()
        together = await asyncio.gather(*tasks)
        (await first).ticket.release()
        alone = [await embed(scheduler, r) for r in mixed]
        return together, alone

    together, alone = run(body(), scheduler)
    for request, in_batch, by_itself in zip(mixed, together, alone, strict=True):
        assert in_batch.answer.timings.batch_requests == len(mixed)
        assert in_batch.answer.timings.batch_tokens == total
        assert by_itself.answer.timings.batch_requests == 1
        assert in_batch.payload == by_itself.payload == reference(request, small_rows)
        assert in_batch.answer.shape == by_itself.answer.shape
        assert in_batch.answer.dtype == by_itself.answer.dtype
    # One onnxruntime run for the whole mixed batch; one report per batch.
    assert [len(c.ids) for c in gated.calls] == [8, total] + [a.answer.tokens for a in alone]
    assert reports.batches == [("small", 1, 8), ("small", len(mixed), total)] + [
        ("small", 1, a.answer.tokens) for a in alone
    ]
    for served in together + alone:
        served.ticket.release()
    assert budget.inflight_bytes == 0


def test_every_compute_of_a_table_is_reported_once_as_a_batch_of_one(
    make_scheduler: Callable[..., Scheduler], backends: dict[str, Backend]
) -> None:
    reports = Reports()
    scheduler = make_scheduler(backends["table"], observer=reports)
    # Every form and dtype, inline and off-loop: all report the same way.
    sent = [request_of(form, size) for size in SIZES for form in FORMS]

    async def body() -> list[int]:
        tokens = []
        for request in sent:
            served = await embed(scheduler, request)
            tokens.append(served.answer.tokens)
            served.ticket.release()
        return tokens

    tokens = run(body(), scheduler)
    assert reports.batches == [("small", 1, count) for count in tokens]
    assert tokens == [8] * len(FORMS) + [8192] * len(FORMS)
    assert reports.drops == []


def test_onnxruntime_reports_one_batch_per_run_whatever_the_placement(
    make_scheduler: Callable[..., Scheduler], backends: dict[str, Backend]
) -> None:
    reports = Reports()
    spy = HookedBackend(backends["onnxruntime"])
    scheduler = make_scheduler(spy, observer=reports)

    async def body() -> None:
        for form in ("rect-int64-float32", "padded-int32-float32", "flat-int32-float16"):
            for size in SIZES:  # tiny: computed on the loop; large: on the batch thread
                (await embed(scheduler, request_of(form, size))).ticket.release()

    run(body(), scheduler)
    # One report per run, telling what that run computed.
    assert [(r, t) for _, r, t in reports.batches] == [(1, 8), (1, 8192)] * 3
    assert [(len(c.counts), sum(c.counts)) for c in spy.calls] == [(1, 8), (1, 8192)] * 3
    assert [thread_kind(c.thread) for c in spy.calls] == ["loop", "batch"] * 3


# --- admission


@pytest.mark.parametrize("kind", ["table", "onnxruntime"])
def test_a_ticket_holds_its_room_until_released(
    make_scheduler: Callable[..., Scheduler], backends: dict[str, Backend], kind: str
) -> None:
    budget = OutputBudget(1 << 30)
    scheduler = make_scheduler(backends[kind], budget=budget)

    async def body() -> list[Served]:
        held = []
        for size in SIZES:
            held.append(await embed(scheduler, request_of("padded-int64-float16", size)))
            # Everything served so far is still counted: nothing has been released.
            assert budget.inflight_bytes == sum(s.answer.nbytes for s in held)
        return held

    held = run(body(), scheduler)
    assert budget.inflight_bytes == sum(s.answer.nbytes for s in held) > 0
    for index, served in enumerate(held):
        served.ticket.release()
        served.ticket.release()  # idempotent: a done callback and a finally may both run
        assert budget.inflight_bytes == sum(s.answer.nbytes for s in held[index + 1 :])
    assert budget.inflight_bytes == 0


def test_overloaded_past_the_queue_bound_while_a_batch_computes(
    make_scheduler: Callable[..., Scheduler], ort_loaded: LoadedModel
) -> None:
    gated = HookedBackend(ort_loaded.backend, Gate(open=False))
    reports, budget = Reports(), OutputBudget(1 << 30)
    scheduler = make_scheduler(
        gated, observer=reports, budget=budget, max_queued_tokens=100, **NEVER_INLINE
    )

    def tokens(count: int) -> EmbedInput:
        return rectangular(token_ids(count, "<i8").reshape(1, -1))

    async def body() -> list[Served]:
        try:
            first = asyncio.ensure_future(embed(scheduler, tokens(5)))
            await entered(gated)  # computing: its tokens are no longer queued
            queued = [asyncio.ensure_future(embed(scheduler, tokens(80)))]
            await until(lambda: scheduler.queued_tokens() == 80, [first, *queued])
            held = budget.inflight_bytes
            with pytest.raises(Overloaded, match=r"80 tokens queued, 30 more .* limit of 100"):
                scheduler.admit(validated(scheduler, tokens(30)))
            assert budget.inflight_bytes == held  # the refused one took no room
            # Exactly at the bound is still admitted.
            queued.append(asyncio.ensure_future(embed(scheduler, tokens(20))))
            await until(lambda: scheduler.queued_tokens() == 100, [first, *queued])
        finally:
            gated.gate.open()
        return [await first, *await asyncio.gather(*queued)]

    served = run(body(), scheduler)
    assert [s.answer.tokens for s in served] == [5, 80, 20]
    assert reports.batches == [("small", 1, 5), ("small", 2, 100)]
    for each in served:
        each.ticket.release()
    assert budget.inflight_bytes == 0


def test_overloaded_past_the_output_budget_shared_by_two_schedulers(
    make_scheduler: Callable[..., Scheduler], backends: dict[str, Backend], small_rows: np.ndarray
) -> None:
    table_request = request_of("rect-int64-float32", "large")  # 2 MiB
    ort_request = request_of("rect-int32-float16", "large")  # 1 MiB
    table_bytes, ort_bytes = 8192 * SMALL_D * 4, 8192 * SMALL_D * 2
    one_more = rectangular(np.array([[5]], "<i8"), "float16")  # 128 bytes
    # Room for both large answers, to the byte: one budget for the process, not per model.
    budget = OutputBudget(table_bytes + ort_bytes)
    table_spy, ort_spy = HookedBackend(backends["table"]), HookedBackend(backends["onnxruntime"])
    table = make_scheduler(table_spy, budget=budget)
    ort = make_scheduler(ort_spy, budget=budget)

    async def body() -> None:
        held_by_table = await embed(table, table_request)
        held_by_ort = await embed(ort, ort_request)  # exactly at the bound
        assert budget.inflight_bytes == budget.max_bytes
        # One answer more, from either scheduler, would pass the shared bound: refused
        # before any compute.
        refusal = f"{budget.max_bytes} output bytes in flight, 128 more"
        for scheduler in (ort, table):
            with pytest.raises(Overloaded, match=refusal):
                scheduler.admit(validated(scheduler, one_more))
        assert budget.inflight_bytes == budget.max_bytes
        assert (len(table_spy.calls), len(ort_spy.calls)) == (1, 1)
        # Room given back by one scheduler serves the other.
        held_by_table.ticket.release()
        again = await embed(ort, ort_request)
        assert again.payload == reference(ort_request, small_rows)
        for served in (held_by_ort, again):
            served.ticket.release()
        assert budget.inflight_bytes == 0

    run(body(), table, ort)


# --- failures, deadlines, reports, shutdown


# A request placed each way under the server's own policy: (backend, size).
EVERYWHERE = {
    "inline": ("table", "tiny"),
    "off-loop": ("table", "large"),
    "batched-alone": ("onnxruntime", "tiny"),  # beside the idle batcher: on the loop
    "batched-queued": ("onnxruntime", "large"),
}


@pytest.mark.parametrize("placement", list(EVERYWHERE))
def test_a_compute_that_raises_is_internal_and_reported_as_no_batch(
    make_scheduler: Callable[..., Scheduler], backends: dict[str, Backend], placement: str
) -> None:
    kind, size = EVERYWHERE[placement]
    spy, reports = HookedBackend(backends[kind], fail_when=failing()), Reports()
    budget = OutputBudget(1 << 30)
    scheduler = make_scheduler(spy, observer=reports, budget=budget)
    frame = Frame()
    request = request_of("padded-int64-float16", size)
    with pytest.raises(Internal, match="the look-up failed: injected look-up failure"):
        run(embed(scheduler, request, None, frame), scheduler)
    assert len(spy.calls) == 1  # it was tried, once
    assert budget.inflight_bytes == 0
    # A failed compute is no batch served, and nothing was framed.
    assert reports.batches == [] and frame.framed == []


@pytest.mark.parametrize("placement", list(EVERYWHERE))
def test_a_backend_that_loses_rows_is_internal_naming_the_counts(
    make_scheduler: Callable[..., Scheduler], backends: dict[str, Backend], placement: str
) -> None:
    kind, size = EVERYWHERE[placement]
    spy, budget = HookedBackend(backends[kind], lose_last_row=True), OutputBudget(1 << 30)
    scheduler = make_scheduler(spy, budget=budget)
    request = request_of("flat-int32-float16", size)
    tokens = SIZES[size][0]
    frame = Frame()
    # A short answer must never reach the caller: its shape would promise rows it lacks.
    with pytest.raises(Internal, match=f"gave {tokens - 1} rows for {tokens} ids"):
        run(embed(scheduler, request, None, frame), scheduler)
    assert frame.framed == []
    assert budget.inflight_bytes == 0


@pytest.mark.parametrize("placement", list(EVERYWHERE))
def test_a_passed_deadline_fails_before_any_compute(
    make_scheduler: Callable[..., Scheduler], backends: dict[str, Backend], placement: str
) -> None:
    kind, size = EVERYWHERE[placement]
    spy, reports, budget = HookedBackend(backends[kind]), Reports(), OutputBudget(1 << 30)
    scheduler = make_scheduler(spy, observer=reports, budget=budget)
    request, frame = request_of("rect-int64-float32", size), Frame()
    with pytest.raises(DeadlineExceeded):
        run(embed(scheduler, request, time.monotonic() - 1, frame), scheduler)
    assert spy.calls == [] and frame.framed == []
    assert budget.inflight_bytes == 0
    assert reports.batches == []
    # The batcher counts the compute it saved; a request that never queued is not a drop.
    want = [("small", "deadline_exceeded")] if placement == "batched-queued" else []
    assert reports.drops == want


@pytest.mark.parametrize("placement", list(EVERYWHERE))
def test_a_failing_report_does_not_fail_the_request(
    make_scheduler: Callable[..., Scheduler],
    backends: dict[str, Backend],
    small_rows: np.ndarray,
    placement: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    kind, size = EVERYWHERE[placement]
    reports = Reports(fail=True)
    scheduler = make_scheduler(backends[kind], observer=reports)
    request = request_of("padded-int32-float32", size)
    served = run(embed(scheduler, request), scheduler)
    assert served.payload == reference(request, small_rows)
    served.ticket.release()
    assert len(reports.batches) == 1  # the report was made, and raised
    assert "batch report failed" in caplog.text  # logged, not swallowed silently


def test_close_fails_what_is_queued_and_lets_the_computing_batch_finish(
    make_scheduler: Callable[..., Scheduler], ort_loaded: LoadedModel, small_rows: np.ndarray
) -> None:
    gated = HookedBackend(ort_loaded.backend, Gate(open=False))
    budget = OutputBudget(1 << 30)
    scheduler = make_scheduler(gated, budget=budget, **NEVER_INLINE)
    computing = request_of("rect-int64-float32", "tiny")

    async def body() -> None:
        try:
            first = asyncio.ensure_future(embed(scheduler, computing))
            await entered(gated)
            queued = [
                asyncio.ensure_future(embed(scheduler, request_of(form, "tiny"))) for form in FORMS
            ]
            await until(lambda: scheduler.queued_tokens() == 8 * len(FORMS), [first, *queued])
            closing = asyncio.ensure_future(scheduler.close())
            # The queued ones fail at once, while the batch computing still holds.
            # (Bounded: a close that forgot them would leave them waiting for ever.)
            outcomes = await asyncio.wait_for(asyncio.gather(*queued, return_exceptions=True), 10)
            assert all(isinstance(o, Unavailable) for o in outcomes), outcomes
            assert not first.done() and not closing.done()
            assert budget.inflight_bytes == 8 * SMALL_D * 4  # only the computing one's room
        finally:
            gated.gate.open()
        await closing
        served = await first
        assert served.payload == reference(computing, small_rows)
        served.ticket.release()
        # Closed: a new request is refused and holds nothing.
        with pytest.raises(Unavailable):
            await embed(scheduler, computing)
        assert budget.inflight_bytes == 0
        assert [len(c.ids) for c in gated.calls] == [8]  # the queued ones never ran

    run(body())


def test_a_failing_drop_report_leaves_no_queued_request_waiting(
    make_scheduler: Callable[..., Scheduler], ort_loaded: LoadedModel, small_rows: np.ndarray
) -> None:
    # As for batch_done above: a report that fails must not fail (or here, strand) the
    # requests around the one it reports.
    class FailingDrops(Reports):
        def dropped(self, model: str, reason: str) -> None:
            super().dropped(model, reason)
            raise RuntimeError("the metrics broke")

    gated = HookedBackend(ort_loaded.backend, Gate(open=False))
    reports = FailingDrops()
    scheduler = make_scheduler(gated, observer=reports, **NEVER_INLINE)
    live = request_of("rect-int64-float32", "tiny")

    async def body() -> Served:
        try:
            first = asyncio.ensure_future(embed(scheduler, live))
            await entered(gated)
            # Queued behind the computing batch: one whose deadline has passed (dropped,
            # and reported, when the next batch is taken), then one with no deadline.
            expired = asyncio.ensure_future(embed(scheduler, live, time.monotonic() - 1))
            waiting = asyncio.ensure_future(embed(scheduler, live))
            await until(lambda: scheduler.queued_tokens() == 16, [first, expired, waiting])
        finally:
            gated.gate.open()
        (await first).ticket.release()
        with pytest.raises(DeadlineExceeded):
            await expired
        # Bounded: the failure this guards against is a request that never completes.
        return await asyncio.wait_for(waiting, 5)

    served = run(body(), scheduler)
    assert served.payload == reference(live, small_rows)
    served.ticket.release()
    assert reports.drops == [("small", "deadline_exceeded")]


@pytest.mark.parametrize(
    ("output", "tokens", "on"),
    [
        ("float32", 63, "loop"),
        ("float32", 64, "batch"),
        # The bound weighs the answer's bytes (the setting says "under 1 MiB of answer"):
        # float16 rows are half as many bytes.
        ("float16", 127, "loop"),
        ("float16", 128, "batch"),
    ],
)
def test_a_batch_over_the_inline_byte_bound_leaves_the_loop(
    make_scheduler: Callable[..., Scheduler],
    ort_loaded: LoadedModel,
    small_rows: np.ndarray,
    output: str,
    tokens: int,
    on: str,
) -> None:
    # inline_compute_max_tokens promises "look-ups (and batches) of up to this many
    # tokens, under 1 MiB of answer, run on the event loop". At D=64, 256 tokens never
    # reach 1 MiB, so the byte bound is lowered to 16 KiB, where a batch's float32 answer
    # (256 bytes a row) stays under it up to 63 tokens: the same cut as a model at D=1024
    # and 1 MiB makes at 255. The batch is made by holding the batcher busy first (a
    # request beside an idle batcher would be placed alone, by the same bounds).
    spy = gated = HookedBackend(ort_loaded.backend, Gate(open=False))
    scheduler = make_scheduler(spy, inline_max_tokens=INLINE_TOKENS, inline_max_bytes=16 << 10)
    busy = request_of("rect-int64-float32", "large")
    request = rectangular(token_ids(tokens, "<i8").reshape(1, -1), output)
    frame = Frame()

    async def body() -> Served:
        try:
            first = asyncio.ensure_future(embed(scheduler, busy))
            await entered(gated)
            task = asyncio.ensure_future(embed(scheduler, request, None, frame))
            await until(lambda: scheduler.queued_tokens() == tokens, [first, task])
        finally:
            gated.gate.open()
        (await first).ticket.release()
        return await task

    served = run(body(), scheduler)
    assert served.payload == reference(request, small_rows)
    served.ticket.release()
    assert [(thread_kind(c.thread), c.counts) for c in spy.calls] == [
        ("batch", [8192]),
        (on, [tokens]),
    ]
    # The frame follows the answer's own bytes.
    frames_inline = served.answer.nbytes < 16 << 10
    assert [thread_kind(t) for t in frame.threads] == ["loop" if frames_inline else "workers"]
