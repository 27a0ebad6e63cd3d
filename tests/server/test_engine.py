"""``Engine``: one model's request path (validate, admit, place, look up, report, answer,
encode), built by hand around the real backends of the small model: the table backend
(as the server loads it) and the onnxruntime backend (``float32_table_max_bytes=0``).

Proved here:
- one path: every placement (inline, off-loop, batched alone, batched in a queue) gives
  the same bytes for the same request, bit-identical to ``E[id] * sqrt(D)``, for
  rectangular, ragged padded and ragged flat requests, float32 and float16, int64 and
  int32 ids; each placement is checked to have happened where the policy says (the
  thread of the look-up and of the encode);
- a request placed inline completes without suspending (its coroutine ends on its first
  step, with no event loop at all) and is encoded on the calling thread; a large one is
  encoded on a ``workers`` thread;
- a token's vector is the same alone or inside a large mixed batch;
- batches are reported from one place, once per look-up, with the right counts;
- admission: a refused or failed request holds no room; a served one holds it until its
  ticket is released; ``Overloaded`` past the queue bound and past the shared budget;
- a passed deadline fails before any look-up; a failing report (of a batch, or of a
  drop) fails no request and strands none; a backend that loses rows is ``Internal``
  naming the counts; ``close`` fails what is queued with ``Unavailable``;
- a batch is looked up on the loop only under the inline byte bound too, not just the
  token bound.

Look-ups are held at a gate (``support.gates.GatedBackend``) wherever a test needs
requests to queue: nothing here waits on time.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from tokembed.server.backends.base import Backend, Rows
from tokembed.server.core.admission import OutputBudget
from tokembed.server.core.engine import BatchLimits, Engine, Served
from tokembed.server.core.errors import (
    DeadlineExceeded,
    Internal,
    InvalidInput,
    Overloaded,
    TooLarge,
    Unavailable,
)
from tokembed.server.core.policy import INLINE_MAX_BYTES, Policy
from tokembed.server.core.types import FLAT, PADDED, Answer, EmbedInput, TokenIds
from tokembed.server.core.validation import Limits
from tokembed.server.loading import LoadedModel, load_model
from tokembed.server.settings import Settings

from support.fixtures import SMALL_D, SMALL_PAD, SMALL_V
from support.gates import GatedBackend

T = TypeVar("T")

WORKERS = "test-workers"  # the thread name prefix of the engines' ``workers``
BATCH_THREADS = "tokembed-batch-"  # the engine's own batch threads
INLINE_TOKENS = 256  # the server's default inline_compute_max_tokens
MAX_TOKENS = 65536
# Policies that force a placement whatever the size, to put one request everywhere.
NEVER_INLINE = {"inline_max_tokens": 0, "inline_max_bytes": 0}
ALWAYS_INLINE = {"inline_max_tokens": 1 << 30, "inline_max_bytes": 1 << 40}


# --- what the engine is given, and what it reports


class Spy(Backend):
    """The real backend, every call recorded with the thread it ran on; it can be made
    to fail, or to lose the last row of each request (a backend bug)."""

    def __init__(self, inner: Backend, *, fail: bool = False, lose_a_row: bool = False) -> None:
        self._inner = inner
        self._fail = fail
        self._lose_a_row = lose_a_row
        self.kind = inner.kind
        self.execution_provider = inner.execution_provider
        self.d_model = inner.d_model
        self.batches = inner.batches
        # (method, thread name, token count of each request looked up)
        self.calls: list[tuple[str, str, list[int]]] = []

    def look_up(self, ids: TokenIds, dtype: np.dtype) -> Rows:
        self._record("look_up", [ids])
        return self._inner.look_up(self._cut(ids), dtype)

    def look_up_batch(self, requests: Sequence[tuple[TokenIds, np.dtype]]) -> list[Rows]:
        self._record("look_up_batch", [ids for ids, _ in requests])
        return self._inner.look_up_batch([(self._cut(ids), dtype) for ids, dtype in requests])

    def pad_row(self, dtype: np.dtype) -> bytes:
        return self._inner.pad_row(dtype)

    # close() is not passed on: the real backends are shared by every test of the module.

    def _record(self, method: str, ids: list[TokenIds]) -> None:
        self.calls.append((method, threading.current_thread().name, [i.count for i in ids]))
        if self._fail:
            raise RuntimeError("injected look-up failure")

    def _cut(self, ids: TokenIds) -> TokenIds:
        if not self._lose_a_row:
            return ids
        kept = ids.array()[:-1]
        return TokenIds(kept.astype("<i8").tobytes(), np.dtype("<i8"), len(kept))


class Reports:
    """The engine's observer: every batch and every drop it is told of."""

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


class Encoder:
    """The caller's ``encode``: records each answer and the thread it ran on, and returns
    the answer's bytes joined (what a response would carry after its header)."""

    def __init__(self) -> None:
        self.answers: list[Answer] = []
        self.threads: list[str] = []

    def __call__(self, answer: Answer) -> bytes:
        self.answers.append(answer)
        self.threads.append(threading.current_thread().name)
        return b"".join(answer.pieces)


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


# --- engines


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
def make_engine(small_loaded: LoadedModel, workers: ThreadPoolExecutor) -> Callable[..., Engine]:
    """``make_engine(backend, ...)``: an engine as the server builds one (its policy from
    the backend, the server's default inline bound), each part replaceable."""

    def make(
        backend: Backend,
        *,
        budget: OutputBudget | None = None,
        observer: Reports | None = None,
        max_queued_tokens: int = 1 << 20,
        **policy: Any,
    ) -> Engine:
        policy.setdefault("inline_max_tokens", INLINE_TOKENS)
        return Engine(
            small_loaded.model,
            backend,
            limits=Limits(SMALL_V, SMALL_D, MAX_TOKENS, 1 << 30),
            batch=BatchLimits(
                max_batch_tokens=16384,
                max_delay_s=0.002,
                max_concurrent_batches=1,
                max_queued_tokens=max_queued_tokens,
            ),
            policy=Policy(batches=backend.batches, **policy),
            budget=budget if budget is not None else OutputBudget(1 << 30),
            workers=workers,
            observer=observer,
        )

    return make


def run(body: Coroutine[Any, Any, T], *engines: Engine) -> T:
    """Run ``body`` in a fresh event loop, then close ``engines`` in that same loop."""

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
                for engine in engines:
                    await engine.close()
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


async def entered(gated: GatedBackend) -> None:
    """Wait until a look-up is held at the gate."""
    assert await asyncio.to_thread(gated.entered.wait, 30), "no look-up reached the gate"


def thread_kind(name: str) -> str:
    if name == threading.current_thread().name:
        return "loop"
    if name.startswith(WORKERS):
        return "workers"
    if name.startswith(BATCH_THREADS):
        return "batch"
    raise AssertionError(f"ran on an unexpected thread {name!r}")


# --- one path


# Each placement: the backend, the policy that forces it, and where the look-up and the
# encode must run (loop: the caller's thread; workers: the shared pool; batch: the
# engine's batch thread), for a tiny and for a large request.
PLACEMENTS: dict[str, dict[str, tuple[str, dict[str, int], str, str, str]]] = {
    "tiny": {
        "inline": ("table", {}, "look_up", "loop", "loop"),
        "off-loop": ("table", NEVER_INLINE, "look_up", "workers", "workers"),
        "batched-alone": ("onnxruntime", {}, "look_up_batch", "loop", "loop"),
        "batched-queued": ("onnxruntime", NEVER_INLINE, "look_up_batch", "batch", "workers"),
    },
    "large": {
        "inline": ("table", ALWAYS_INLINE, "look_up", "loop", "loop"),
        "off-loop": ("table", {}, "look_up", "workers", "workers"),
        "batched-alone": ("onnxruntime", ALWAYS_INLINE, "look_up_batch", "loop", "loop"),
        "batched-queued": ("onnxruntime", {}, "look_up_batch", "batch", "workers"),
    },
}


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("form", list(FORMS))
def test_every_placement_gives_the_reference_bytes(
    make_engine: Callable[..., Engine],
    backends: dict[str, Backend],
    small_rows: np.ndarray,
    form: str,
    size: str,
) -> None:
    request = request_of(form, size)
    if size == "large":
        assert_large(request)  # with the server's own policy, it must leave the loop
    want = reference(request, small_rows)
    for placement, (kind, policy, method, look_up_on, encode_on) in PLACEMENTS[size].items():
        spy, encode, budget = Spy(backends[kind]), Encoder(), OutputBudget(1 << 30)
        engine = make_engine(spy, budget=budget, **policy)
        served = run(engine.embed(request, None, encode), engine)
        where = f"{form} {size} {placement}"

        assert served.payload == want, where
        (answer,) = encode.answers
        assert answer.shape == served.shape == answer_shape(request), where
        assert answer.dtype == served.dtype == np.dtype(request.output_dtype), where
        assert answer.lengths == (request.lengths or None), where
        assert served.nbytes == len(want) and served.tokens == tokens_of(request), where
        assert (served.timings.batch_requests, served.timings.batch_tokens) == (1, served.tokens)
        # ...and it ran where this placement runs, with one look-up.
        assert [(m, thread_kind(t)) for m, t, _ in spy.calls] == [(method, look_up_on)], where
        assert [thread_kind(t) for t in encode.threads] == [encode_on], where
        # Served, not yet sent: the room is held until the ticket is released.
        assert budget.inflight_bytes == served.nbytes, where
        served.ticket.release()
        assert budget.inflight_bytes == 0, where


@pytest.mark.parametrize("kind", ["table", "onnxruntime"])
def test_an_inline_request_completes_without_suspending_on_the_calling_thread(
    make_engine: Callable[..., Engine],
    backends: dict[str, Backend],
    small_rows: np.ndarray,
    kind: str,
) -> None:
    request = request_of("padded-int32-float32", "tiny")
    spy, encode = Spy(backends[kind]), Encoder()
    engine = make_engine(spy)
    # No event loop at all: a first step that suspended (awaited a thread, a future, a
    # batch) would hand back what it awaits instead of finishing.
    coroutine = engine.embed(request, None, encode)
    with pytest.raises(StopIteration) as finished:
        coroutine.send(None)
    served: Served[bytes] = finished.value.value
    assert served.payload == reference(request, small_rows)
    here = threading.current_thread().name
    assert encode.threads == [here]
    assert [thread for _, thread, _ in spy.calls] == [here]
    served.ticket.release()
    asyncio.run(engine.close())


def test_only_a_request_that_leaves_the_loop_lets_other_tasks_run(
    make_engine: Callable[..., Engine], backends: dict[str, Backend], small_rows: np.ndarray
) -> None:
    engine = make_engine(backends["table"])
    turns: list[str] = []

    async def bystander(label: str) -> None:
        turns.append(label)

    async def body() -> None:
        for size in ("tiny", "large"):
            request = request_of("rect-int64-float32", size)
            task = asyncio.ensure_future(bystander(size))
            encode = Encoder()
            served = await engine.embed(request, None, encode)
            # A tiny request ran to its end before the loop could start anyone else.
            assert (size in turns) is (size == "large")
            assert thread_kind(encode.threads[0]) == ("loop" if size == "tiny" else "workers")
            assert served.payload == reference(request, small_rows)
            served.ticket.release()
            await task

    run(body(), engine)


# --- batches


def test_a_token_s_vector_is_the_same_alone_or_in_a_large_mixed_batch(
    make_engine: Callable[..., Engine], ort_loaded: LoadedModel, small_rows: np.ndarray
) -> None:
    gated = GatedBackend(ort_loaded.backend, threading.Event())
    reports, budget = Reports(), OutputBudget(1 << 30)
    # No look-up on the loop (one held at the gate would hold the loop); answers encoded
    # where the server's byte bound says.
    engine = make_engine(gated, observer=reports, budget=budget, inline_max_tokens=0)
    # Every form at two sizes, one answer of INLINE_MAX_BYTES (encoded off-loop, the
    # others on the loop), and one id alone in both dtypes; the ids repeat across
    # requests. Sized to fit one batch.
    mixed = [request_of(form, "tiny") for form in FORMS]
    mixed += [FORMS[form](1500, (700, 1, 799)) for form in FORMS if form != "rect-int32-float16"]
    mixed += [request_of("rect-int32-float16", "large")]
    mixed += [rectangular(np.array([[7]], "<i8")), rectangular(np.array([[7]], "<i4"), "float16")]
    total = sum(tokens_of(r) for r in mixed)
    assert total <= 16384  # max_batch_tokens: one batch

    async def body() -> tuple[list[Served[bytes]], list[Served[bytes]]]:
        try:
            # The first request holds the backend; the others queue behind it.
            first = asyncio.ensure_future(engine.embed(mixed[0], None, Encoder()))
            await entered(gated)
            tasks = [asyncio.ensure_future(engine.embed(r, None, Encoder())) for r in mixed]
            await until(lambda: engine.queued_tokens() == total, [first, *tasks])
        finally:
            gated.gate.set()
        together = await asyncio.gather(*tasks)
        (await first).ticket.release()
        alone = [await engine.embed(r, None, Encoder()) for r in mixed]
        return together, alone

    together, alone = run(body(), engine)
    for request, in_batch, by_itself in zip(mixed, together, alone, strict=True):
        assert in_batch.timings.batch_requests == len(mixed)
        assert in_batch.timings.batch_tokens == total
        assert by_itself.timings.batch_requests == 1
        assert in_batch.payload == by_itself.payload == reference(request, small_rows)
        assert in_batch.shape == by_itself.shape and in_batch.dtype == by_itself.dtype
    # One onnxruntime run for the whole mixed batch; one report per batch.
    assert [len(ids) for ids in gated.calls] == [8, total] + [a.tokens for a in alone]
    name = engine.name
    assert reports.batches == [(name, 1, 8), (name, len(mixed), total)] + [
        (name, 1, a.tokens) for a in alone
    ]
    for served in together + alone:
        served.ticket.release()
    assert budget.inflight_bytes == 0


def test_every_look_up_of_a_table_is_reported_once_as_a_batch_of_one(
    make_engine: Callable[..., Engine], backends: dict[str, Backend]
) -> None:
    reports = Reports()
    engine = make_engine(backends["table"], observer=reports)
    # Every form and dtype, inline and off-loop: all report the same way.
    sent = [request_of(form, size) for size in SIZES for form in FORMS]

    async def body() -> list[int]:
        tokens = []
        for request in sent:
            served = await engine.embed(request, None, Encoder())
            tokens.append(served.tokens)
            served.ticket.release()
        return tokens

    tokens = run(body(), engine)
    assert reports.batches == [(engine.name, 1, count) for count in tokens]
    assert tokens == [8] * len(FORMS) + [8192] * len(FORMS)
    assert reports.drops == []


def test_onnxruntime_reports_one_batch_per_run_whatever_the_placement(
    make_engine: Callable[..., Engine], backends: dict[str, Backend]
) -> None:
    reports = Reports()
    spy = Spy(backends["onnxruntime"])
    engine = make_engine(spy, observer=reports)

    async def body() -> None:
        for form in ("rect-int64-float32", "padded-int32-float32", "flat-int32-float16"):
            for size in SIZES:  # tiny: looked up on the loop; large: on the batch thread
                (await engine.embed(request_of(form, size), None, Encoder())).ticket.release()

    run(body(), engine)
    # One report per run, telling what that run looked up.
    assert [(r, t) for _, r, t in reports.batches] == [(1, 8), (1, 8192)] * 3
    assert [(len(c), sum(c)) for _, _, c in spy.calls] == [(1, 8), (1, 8192)] * 3
    assert {thread_kind(t) for _, t, _ in spy.calls} == {"loop", "batch"}


# --- admission


BAD_REQUESTS = {
    "outside-vocabulary": (
        rectangular(np.array([[1, SMALL_V]], "<i8")), InvalidInput, "outside the vocabulary",
    ),
    "negative-id": (rectangular(np.array([[-1, 2]], "<i4")), InvalidInput, "outside"),
    "id-dtype": (EmbedInput("uint8", (1, 2), b"\x01\x02"), InvalidInput, "uint8"),
    "output-dtype": (rectangular(np.array([[1]], "<i8"), "bfloat16"), InvalidInput, "bfloat16"),
    "lengths": (ragged(np.array([1, 2, 3], "<i8"), (2, 2)), InvalidInput, "lengths sum"),
    "too-many-tokens": (
        rectangular(np.ones((1, MAX_TOKENS + 1), "<i4")), TooLarge, "over the limit",
    ),
}  # fmt: skip


@pytest.mark.parametrize("bad", list(BAD_REQUESTS))
@pytest.mark.parametrize("kind", ["table", "onnxruntime"])
def test_a_request_refused_by_validation_holds_no_room_and_reaches_no_backend(
    make_engine: Callable[..., Engine], backends: dict[str, Backend], kind: str, bad: str
) -> None:
    request, error, message = BAD_REQUESTS[bad]
    spy, reports, budget = Spy(backends[kind]), Reports(), OutputBudget(1 << 30)
    engine = make_engine(spy, observer=reports, budget=budget)
    encode = Encoder()
    with pytest.raises(error, match=message):
        run(engine.embed(request, None, encode), engine)
    assert budget.inflight_bytes == 0
    assert spy.calls == [] and encode.answers == []
    assert reports.batches == [] and reports.drops == []


# A request placed each way under the server's own policy: (backend, size).
EVERYWHERE = {
    "inline": ("table", "tiny"),
    "off-loop": ("table", "large"),
    "batched-alone": ("onnxruntime", "tiny"),  # the idle batcher's look-up on the loop
    "batched-queued": ("onnxruntime", "large"),
}


@pytest.mark.parametrize("placement", list(EVERYWHERE))
def test_a_look_up_that_raises_is_internal_and_gives_its_room_back(
    make_engine: Callable[..., Engine], backends: dict[str, Backend], placement: str
) -> None:
    kind, size = EVERYWHERE[placement]
    spy, reports = Spy(backends[kind], fail=True), Reports()
    budget = OutputBudget(1 << 30)
    engine = make_engine(spy, observer=reports, budget=budget)
    encode = Encoder()
    with pytest.raises(Internal, match="the look-up failed: injected look-up failure"):
        run(engine.embed(request_of("padded-int64-float16", size), None, encode), engine)
    assert len(spy.calls) == 1  # it was tried, once
    assert budget.inflight_bytes == 0
    # A failed look-up is no batch served, and nothing was encoded.
    assert reports.batches == [] and encode.answers == []


@pytest.mark.parametrize("placement", list(EVERYWHERE))
def test_a_backend_that_loses_rows_is_internal_naming_the_counts(
    make_engine: Callable[..., Engine], backends: dict[str, Backend], placement: str
) -> None:
    kind, size = EVERYWHERE[placement]
    spy, budget = Spy(backends[kind], lose_a_row=True), OutputBudget(1 << 30)
    engine = make_engine(spy, budget=budget)
    request = request_of("flat-int32-float16", size)
    tokens = SIZES[size][0]
    encode = Encoder()
    # A short answer must never reach the caller: its shape would promise rows it lacks.
    with pytest.raises(Internal, match=f"gave {tokens - 1} rows for {tokens} ids"):
        run(engine.embed(request, None, encode), engine)
    assert encode.answers == []
    assert budget.inflight_bytes == 0


def test_a_served_request_holds_its_room_until_its_ticket_is_released(
    make_engine: Callable[..., Engine], backends: dict[str, Backend]
) -> None:
    budget = OutputBudget(1 << 30)
    engines = [make_engine(backends[kind], budget=budget) for kind in ("table", "onnxruntime")]

    async def body() -> list[Served[bytes]]:
        held = []
        for engine in engines:
            for size in SIZES:
                request = request_of("padded-int64-float16", size)
                held.append(await engine.embed(request, None, Encoder()))
                # Everything served so far is still counted: nothing has been sent.
                assert budget.inflight_bytes == sum(s.nbytes for s in held)
        return held

    held = run(body(), *engines)
    assert budget.inflight_bytes == sum(s.nbytes for s in held) > 0
    for index, served in enumerate(held):
        served.ticket.release()
        served.ticket.release()  # idempotent: a done callback and a finally may both run
        assert budget.inflight_bytes == sum(s.nbytes for s in held[index + 1 :])
    assert budget.inflight_bytes == 0


def test_overloaded_past_the_queue_bound_while_a_batch_computes(
    make_engine: Callable[..., Engine], ort_loaded: LoadedModel
) -> None:
    gated = GatedBackend(ort_loaded.backend, threading.Event())
    reports, budget = Reports(), OutputBudget(1 << 30)
    engine = make_engine(
        gated, observer=reports, budget=budget, max_queued_tokens=100, **NEVER_INLINE
    )

    def tokens(count: int) -> EmbedInput:
        return rectangular(token_ids(count, "<i8").reshape(1, -1))

    async def body() -> list[Served[bytes]]:
        try:
            first = asyncio.ensure_future(engine.embed(tokens(5), None, Encoder()))
            await entered(gated)  # computing: its tokens are no longer queued
            queued = [asyncio.ensure_future(engine.embed(tokens(80), None, Encoder()))]
            await until(lambda: engine.queued_tokens() == 80, [first, *queued])
            held = budget.inflight_bytes
            with pytest.raises(Overloaded, match=r"80 tokens queued, 30 more .* limit of 100"):
                await engine.embed(tokens(30), None, Encoder())
            assert budget.inflight_bytes == held  # the refused one took no room
            # Exactly at the bound is still admitted.
            queued.append(asyncio.ensure_future(engine.embed(tokens(20), None, Encoder())))
            await until(lambda: engine.queued_tokens() == 100, [first, *queued])
        finally:
            gated.gate.set()
        return [await first, *await asyncio.gather(*queued)]

    served = run(body(), engine)
    assert [s.tokens for s in served] == [5, 80, 20]
    assert reports.batches == [(engine.name, 1, 5), (engine.name, 2, 100)]
    for each in served:
        each.ticket.release()
    assert budget.inflight_bytes == 0


def test_overloaded_past_the_output_budget_shared_by_two_engines(
    make_engine: Callable[..., Engine], backends: dict[str, Backend], small_rows: np.ndarray
) -> None:
    table_request = request_of("rect-int64-float32", "large")  # 2 MiB
    ort_request = request_of("rect-int32-float16", "large")  # 1 MiB
    table_bytes, ort_bytes = 8192 * SMALL_D * 4, 8192 * SMALL_D * 2
    one_more = rectangular(np.array([[5]], "<i8"), "float16")  # 128 bytes
    # Room for both large answers, to the byte: one budget for the process, not per model.
    budget = OutputBudget(table_bytes + ort_bytes)
    table_spy, ort_spy = Spy(backends["table"]), Spy(backends["onnxruntime"])
    table, ort = make_engine(table_spy, budget=budget), make_engine(ort_spy, budget=budget)

    async def body() -> None:
        held_by_table = await table.embed(table_request, None, Encoder())
        held_by_ort = await ort.embed(ort_request, None, Encoder())  # exactly at the bound
        assert budget.inflight_bytes == budget.max_bytes
        # One answer more, from either engine, would pass the shared bound: refused before
        # any look-up.
        refusal = f"{budget.max_bytes} output bytes in flight, 128 more"
        for engine in (ort, table):
            with pytest.raises(Overloaded, match=refusal):
                await engine.embed(one_more, None, Encoder())
        assert budget.inflight_bytes == budget.max_bytes
        assert (len(table_spy.calls), len(ort_spy.calls)) == (1, 1)
        # Room given back by one engine serves the other.
        held_by_table.ticket.release()
        again = await ort.embed(ort_request, None, Encoder())
        assert again.payload == reference(ort_request, small_rows)
        for served in (held_by_ort, again):
            served.ticket.release()
        assert budget.inflight_bytes == 0

    run(body(), table, ort)


# --- deadlines, reports, shutdown


@pytest.mark.parametrize("placement", list(EVERYWHERE))
def test_a_passed_deadline_fails_before_any_look_up(
    make_engine: Callable[..., Engine], backends: dict[str, Backend], placement: str
) -> None:
    kind, size = EVERYWHERE[placement]
    spy, reports, budget = Spy(backends[kind]), Reports(), OutputBudget(1 << 30)
    engine = make_engine(spy, observer=reports, budget=budget)
    request, encode = request_of("rect-int64-float32", size), Encoder()
    with pytest.raises(DeadlineExceeded):
        run(engine.embed(request, time.monotonic() - 1, encode), engine)
    assert spy.calls == [] and encode.answers == []
    assert budget.inflight_bytes == 0
    assert reports.batches == []
    # The batcher counts the look-up it saved; a table's request never queued.
    want = [(engine.name, "deadline_exceeded")] if kind == "onnxruntime" else []
    assert reports.drops == want


@pytest.mark.parametrize("placement", list(EVERYWHERE))
def test_a_failing_report_does_not_fail_the_request(
    make_engine: Callable[..., Engine],
    backends: dict[str, Backend],
    small_rows: np.ndarray,
    placement: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    kind, size = EVERYWHERE[placement]
    reports = Reports(fail=True)
    engine = make_engine(backends[kind], observer=reports)
    request = request_of("padded-int32-float32", size)
    served = run(engine.embed(request, None, Encoder()), engine)
    assert served.payload == reference(request, small_rows)
    served.ticket.release()
    assert len(reports.batches) == 1  # the report was made, and raised
    assert "batch report failed" in caplog.text  # logged, not swallowed silently


def test_close_fails_what_is_queued_and_lets_the_computing_batch_finish(
    make_engine: Callable[..., Engine], ort_loaded: LoadedModel, small_rows: np.ndarray
) -> None:
    gated = GatedBackend(ort_loaded.backend, threading.Event())
    budget = OutputBudget(1 << 30)
    engine = make_engine(gated, budget=budget, **NEVER_INLINE)
    computing = request_of("rect-int64-float32", "tiny")

    async def body() -> None:
        try:
            first = asyncio.ensure_future(engine.embed(computing, None, Encoder()))
            await entered(gated)
            queued = [
                asyncio.ensure_future(engine.embed(request_of(form, "tiny"), None, Encoder()))
                for form in FORMS
            ]
            await until(lambda: engine.queued_tokens() == 8 * len(FORMS), [first, *queued])
            closing = asyncio.ensure_future(engine.close())
            # The queued ones fail at once, while the batch computing still holds.
            # (Bounded: a close that forgot them would leave them waiting for ever.)
            outcomes = await asyncio.wait_for(asyncio.gather(*queued, return_exceptions=True), 10)
            assert all(isinstance(o, Unavailable) for o in outcomes), outcomes
            assert not first.done() and not closing.done()
            assert budget.inflight_bytes == 8 * SMALL_D * 4  # only the computing one's room
        finally:
            gated.gate.set()
        await closing
        served = await first
        assert served.payload == reference(computing, small_rows)
        served.ticket.release()
        # Closed: a new request is refused and holds nothing.
        with pytest.raises(Unavailable):
            await engine.embed(computing, None, Encoder())
        assert budget.inflight_bytes == 0
        assert [len(ids) for ids in gated.calls] == [8]  # the queued ones never ran

    run(body())


def test_a_failing_drop_report_leaves_no_queued_request_waiting(
    make_engine: Callable[..., Engine], ort_loaded: LoadedModel, small_rows: np.ndarray
) -> None:
    # As for batch_done above: a report that fails must not fail (or here, strand) the
    # requests around the one it reports.
    class FailingDrops(Reports):
        def dropped(self, model: str, reason: str) -> None:
            super().dropped(model, reason)
            raise RuntimeError("the metrics broke")

    gated = GatedBackend(ort_loaded.backend, threading.Event())
    reports = FailingDrops()
    engine = make_engine(gated, observer=reports, **NEVER_INLINE)
    live = request_of("rect-int64-float32", "tiny")

    async def body() -> Served[bytes]:
        try:
            first = asyncio.ensure_future(engine.embed(live, None, Encoder()))
            await entered(gated)
            # Queued behind the computing batch: one whose deadline has passed (dropped,
            # and reported, when the next batch is taken), then one with no deadline.
            expired = asyncio.ensure_future(engine.embed(live, time.monotonic() - 1, Encoder()))
            waiting = asyncio.ensure_future(engine.embed(live, None, Encoder()))
            await until(lambda: engine.queued_tokens() == 16, [first, expired, waiting])
        finally:
            gated.gate.set()
        (await first).ticket.release()
        with pytest.raises(DeadlineExceeded):
            await expired
        # Bounded: the failure this guards against is a request that never completes.
        return await asyncio.wait_for(waiting, 5)

    served = run(body(), engine)
    assert served.payload == reference(live, small_rows)
    served.ticket.release()
    assert reports.drops == [(engine.name, "deadline_exceeded")]


@pytest.mark.parametrize("output", ["float32", "float16"])
@pytest.mark.parametrize(("tokens", "on"), [(63, "loop"), (64, "batch")])
def test_a_batched_look_up_over_the_inline_byte_bound_leaves_the_loop(
    make_engine: Callable[..., Engine],
    backends: dict[str, Backend],
    small_rows: np.ndarray,
    tokens: int,
    on: str,
    output: str,
) -> None:
    # inline_compute_max_tokens promises "look-ups (and batches) of up to this many
    # tokens, under 1 MiB of answer, run on the event loop". At D=64, 256 tokens never
    # reach 1 MiB, so the byte bound is lowered to 16 KiB, where a batch's float32 rows
    # (256 bytes each: what a run computes, whatever the dtype asked) stay under it up to
    # 63 tokens: the same cut as a model at D=1024 and 1 MiB makes at 255.
    spy = Spy(backends["onnxruntime"])
    engine = make_engine(spy, inline_max_tokens=INLINE_TOKENS, inline_max_bytes=16 << 10)
    request = rectangular(token_ids(tokens, "<i8").reshape(1, -1), output)
    encode = Encoder()
    served = run(engine.embed(request, None, encode), engine)
    assert served.payload == reference(request, small_rows)
    served.ticket.release()
    assert [thread_kind(t) for _, t, _ in spy.calls] == [on]
    # The encode follows the answer's own bytes (float16: half the rows' bytes).
    encodes_inline = served.nbytes < 16 << 10
    assert [thread_kind(t) for t in encode.threads] == ["loop" if encodes_inline else "workers"]
