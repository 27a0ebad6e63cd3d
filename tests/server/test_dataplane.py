"""``DataPlane``: every protocol's requests served the same way (route, validate, admit,
run, send, release, count), built by hand as the server builds it (a repository of real
schedulers around the small model's real backends, the calls' bookkeeping) and driven as
a front end drives it, through a sink that records what it is given.

Proved here:
- a served request holds its room and its model's lease until its sink says the bytes
  are gone, and not a moment longer (once, however often it is said);
- a request refused by validation, or refused before it could be translated, or for a
  model nobody serves, holds no room and reaches no backend; a compute that fails, a
  sink that fails, or a caller that leaves gives its room and lease back; each outcome is
  counted once, under the front end's protocol, the operation, the method and the model
  that answered ("" for none), with the front end's own status code;
- a tiny request on the table completes without suspending, sink included;
- a stream answers in request order, whatever order the answers are computed in, frames
  a failed request with the sink's error frame and goes on, gives each answer's room
  back once it is sent (a failed compute's at once), and reads no further ahead than its
  window while an answer is held;
- model info and listings are answered from the repository and counted.

The scheduler's own behaviour (placement, batching, reports) is test_scheduler.py's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from tokembed.server.backends.base import Backend
from tokembed.server.core.admission import OutputBudget
from tokembed.server.core.calls import Call, Calls, FrontEnd
from tokembed.server.core.dataplane import (
    STREAM_WINDOW,
    DataPlane,
    Refused,
    Request,
    Sink,
    StreamSink,
)
from tokembed.server.core.errors import (
    EmbedError,
    Internal,
    InvalidInput,
    ModelNotFound,
    TooLarge,
    Unavailable,
)
from tokembed.server.core.operations.embed import EMBED, PADDED, EmbedInput
from tokembed.server.core.policy import Policy
from tokembed.server.core.repository import ModelHandle, Repository
from tokembed.server.core.scheduler import Scheduler
from tokembed.server.core.served import BatchLimits, Limits, ServedModel
from tokembed.server.core.types import Answer
from tokembed.server.models.loading import LoadedModel, load_model
from tokembed.server.process.settings import Settings

from support.backends import Gate, HookedBackend, entered, failing, poisoned_by
from support.fixtures import SMALL_V

T = TypeVar("T")

MAX_TOKENS = 4096
FRONT_END = FrontEnd(
    protocol="test.v1",
    methods={"Embed": "embed", "EmbedStream": "embed", "Info": "model_info", "List": "list_models"},
    status_of=lambda error: error.reason.upper(),
)


# --- what the data plane is given, and what it tells


@dataclass
class Observed:
    """The calls' observer (the metrics, in the server): every outcome it is told of."""

    # (protocol, operation, method, code, model)
    done: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    # (protocol, operation, method, model, tokens, output bytes)
    served: list[tuple[str, str, str, str, int, int]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)  # of every rejection

    def call_done(
        self, protocol: str, operation: str, method: str, code: str, model: str,
        duration_s: float, version: str = "",
    ) -> None:  # fmt: skip
        assert duration_s >= 0
        self.done.append((protocol, operation, method, code, model))

    def call_served(
        self, protocol: str, operation: str, method: str, code: str, model: str,
        duration_s: float, tokens: int, output_bytes: int, queue_s: float,
        encode_s: float | None, version: str = "",
    ) -> None:  # fmt: skip
        assert duration_s >= 0 and queue_s >= 0 and encode_s is not None and encode_s >= 0
        self.served.append((protocol, operation, method, model, tokens, output_bytes))

    def rejected(self, reason: str) -> None:
        self.reasons.append(reason)


class RecordingSink(StreamSink[bytes]):
    """Frames an answer as its bytes joined (or an error as ``error:<reason>``) and sends
    it into a list; ``hold``: keep each ``sent`` for the test to call, as a transport
    that has not yet written the bytes would."""

    def __init__(self, *, hold: bool = False, fail_frame: bool = False) -> None:
        self.hold = hold
        self.fail_frame = fail_frame
        self.answers: list[Answer] = []
        self.sent: list[bytes] = []
        self.pending: list[Callable[[], None]] = []

    def frame(self, answer: Answer, call: Call) -> bytes:
        if self.fail_frame:
            raise RuntimeError("the frame broke")
        self.answers.append(answer)
        return b"".join(answer.pieces)

    def frame_error(self, error: EmbedError) -> bytes:
        return f"error:{error.reason}".encode()

    async def send(self, framed: bytes, sent: Callable[[], None]) -> None:
        self.sent.append(framed)
        if self.hold:
            self.pending.append(sent)
        else:
            sent()


# --- requests and their answers


def rectangular(ids: Any, output: str = "float32") -> EmbedInput:
    array = np.asarray(ids, dtype="<i8")
    return EmbedInput("int64", array.shape, array.tobytes(), (), output, PADDED)


def tiny(seed: int = 0) -> EmbedInput:
    return rectangular(np.random.default_rng(seed).integers(0, SMALL_V, (1, 8)))


def large() -> EmbedInput:
    return rectangular(np.arange(2048).reshape(2, 1024) % SMALL_V)  # 512 KiB, off the loop


def reference(request: EmbedInput, rows: np.ndarray) -> bytes:
    ids = np.frombuffer(request.data, dtype="<i8")
    return rows.astype(request.output_dtype)[ids].tobytes()


def embed(request: EmbedInput | Refused, model: str = "small") -> Request[EmbedInput] | Refused:
    if isinstance(request, Refused):
        return request
    return Request(model, "", request, request_id="r")


# --- the server's parts, as the server wires them


@dataclass
class Plane:
    dataplane: DataPlane
    repository: Repository
    handles: dict[str, ModelHandle]
    budget: OutputBudget
    observed: Observed

    @property
    def calls(self) -> Calls:
        return self.dataplane.calls

    def leases(self) -> int:
        return sum(handle.leases for handle in self.handles.values())


@pytest.fixture(scope="module")
def ort_loaded(small_model_dir: Path) -> Iterator[LoadedModel]:
    loaded = load_model(small_model_dir, Settings(float32_table_max_bytes=0))
    yield loaded
    loaded.backend.close()


@pytest.fixture
def workers() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(2, thread_name_prefix="test-workers")
    yield pool
    pool.shutdown()


@pytest.fixture
def make_plane(small_loaded: LoadedModel, workers: ThreadPoolExecutor) -> Callable[..., Plane]:
    """``make_plane(small=backend, other=backend, ...)``: a data plane over those models
    (the small model's directory, renamed), the first the default, all started."""

    def make(**backends: Backend) -> Plane:
        budget, observed = OutputBudget(1 << 30), Observed()
        repository = Repository()
        handles = {}
        for name, backend in backends.items():
            model = small_loaded.model
            served = ServedModel(
                replace(model, manifest=replace(model.manifest, name=name)),
                backend,
                Limits(max_tokens_per_request=MAX_TOKENS, max_output_bytes_per_request=1 << 30),
                BatchLimits(16384, 0.002, 1, 1 << 20),
            )
            scheduler = Scheduler(
                served, policy=Policy(batches=backend.batches, inline_max_tokens=256),
                budget=budget, workers=workers,
            )  # fmt: skip
            handles[name] = repository.add(scheduler)
            repository.activate(handles[name])
        repository.started()
        dataplane = DataPlane(repository, Calls(observed, summary_interval_s=3600))
        return Plane(dataplane, repository, handles, budget, observed)

    return make


def run(body: Coroutine[Any, Any, T], plane: Plane) -> T:
    """Run ``body`` in a fresh event loop, then close the plane's schedulers there."""

    async def main() -> T:
        try:
            return await asyncio.wait_for(body, 60)
        finally:
            for handle in plane.handles.values():
                await handle.scheduler.close()

    return asyncio.run(main())


async def serve(plane: Plane, incoming: Request[EmbedInput] | Refused, sink: Sink[bytes]) -> None:
    await plane.dataplane.serve(FRONT_END, "Embed", EMBED, incoming, None, sink)


# --- unary


@pytest.mark.parametrize("size", ["tiny", "large"])
@pytest.mark.parametrize("kind", ["table", "onnxruntime"])
def test_a_served_request_holds_its_room_and_lease_until_its_sink_says_sent(
    make_plane: Callable[..., Plane],
    small_loaded: LoadedModel,
    ort_loaded: LoadedModel,
    small_rows: np.ndarray,
    kind: str,
    size: str,
) -> None:
    backend = small_loaded.backend if kind == "table" else ort_loaded.backend
    plane = make_plane(small=backend)
    request = tiny() if size == "tiny" else large()
    sink = RecordingSink(hold=True)
    run(serve(plane, embed(request), sink), plane)

    (answer,) = sink.answers
    assert sink.sent == [reference(request, small_rows)]
    # Answered, not yet sent: the room and the lease are held, the call is no longer
    # in flight (a drain does not wait for the transport).
    assert plane.budget.inflight_bytes == answer.nbytes > 0
    assert plane.handles["small"].leases == 1
    assert plane.calls.active == 0
    (sent,) = sink.pending
    sent()
    sent()  # idempotent: a done callback and a finally may both run
    assert plane.budget.inflight_bytes == 0 and plane.leases() == 0
    tokens = int(np.prod(request.shape))
    assert plane.observed.served == [("test.v1", "embed", "Embed", "small", tokens, answer.nbytes)]
    assert plane.observed.done == [] and plane.observed.reasons == []


BAD_REQUESTS: dict[str, tuple[EmbedInput | Refused, type[EmbedError], str, str]] = {
    "outside-vocabulary": (
        rectangular([[1, SMALL_V]]), InvalidInput, "outside the vocabulary", "small",
    ),
    "negative-id": (
        EmbedInput("int32", (1, 2), np.array([-1, 2], "<i4").tobytes()), InvalidInput,
        "outside", "small",
    ),
    "id-dtype": (EmbedInput("uint8", (1, 2), b"\x01\x02"), InvalidInput, "uint8", "small"),
    "output-dtype": (rectangular([[1]], "float64"), InvalidInput, "float64", "small"),
    "lengths": (
        EmbedInput("int64", (3,), np.arange(3, dtype="<i8").tobytes(), (2, 2)),
        InvalidInput, "lengths sum", "small",
    ),
    "too-many-tokens": (
        rectangular(np.ones((1, MAX_TOKENS + 1))), TooLarge, "over the limit", "small",
    ),
    # Bytes the front end could not translate: refused before any model is known.
    "refused": (Refused(InvalidInput("not a request")), InvalidInput, "not a request", ""),
}  # fmt: skip


@pytest.mark.parametrize("bad", list(BAD_REQUESTS))
@pytest.mark.parametrize("kind", ["table", "onnxruntime"])
def test_a_refused_request_holds_no_room_reaches_no_backend_and_is_counted_once(
    make_plane: Callable[..., Plane],
    small_loaded: LoadedModel,
    ort_loaded: LoadedModel,
    kind: str,
    bad: str,
) -> None:
    request, error, message, model = BAD_REQUESTS[bad]
    spy = HookedBackend(small_loaded.backend if kind == "table" else ort_loaded.backend)
    plane = make_plane(small=spy)
    sink = RecordingSink()
    with pytest.raises(error, match=message):
        run(serve(plane, embed(request), sink), plane)
    assert plane.budget.inflight_bytes == 0 and plane.leases() == 0
    assert spy.calls == [] and sink.sent == [] and sink.answers == []
    assert plane.calls.active == 0
    assert plane.observed.done == [("test.v1", "embed", "Embed", error.reason.upper(), model)]
    assert plane.observed.reasons == [error.reason] and plane.observed.served == []


def test_a_model_nobody_serves_is_not_found_counted_without_a_model(
    make_plane: Callable[..., Plane], small_loaded: LoadedModel
) -> None:
    spy = HookedBackend(small_loaded.backend)
    plane = make_plane(small=spy)
    with pytest.raises(ModelNotFound, match="'nope' is not served here"):
        run(serve(plane, embed(tiny(), "nope"), RecordingSink()), plane)
    assert spy.calls == [] and plane.budget.inflight_bytes == 0
    assert plane.observed.done == [("test.v1", "embed", "Embed", "NOT_FOUND", "")]


@pytest.mark.parametrize("where", ["compute", "frame"])
@pytest.mark.parametrize("size", ["tiny", "large"])
def test_a_failure_gives_the_room_and_the_lease_back_and_is_internal(
    make_plane: Callable[..., Plane],
    small_loaded: LoadedModel,
    size: str,
    where: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    spy = HookedBackend(small_loaded.backend, fail_when=failing() if where == "compute" else None)
    plane = make_plane(small=spy)
    sink = RecordingSink(fail_frame=where == "frame")
    message = "injected look-up failure" if where == "compute" else "the frame broke"
    with pytest.raises(Internal, match=message):
        run(serve(plane, embed(tiny() if size == "tiny" else large()), sink), plane)
    assert plane.budget.inflight_bytes == 0 and plane.leases() == 0
    assert sink.sent == [] and plane.calls.active == 0
    assert plane.observed.done == [("test.v1", "embed", "Embed", "INTERNAL", "small")]
    if where == "frame":  # not a domain error: logged with its traceback
        assert "Embed failed" in caplog.text and "RuntimeError: the frame broke" in caplog.text


@pytest.mark.parametrize(
    ("deadline_in_s", "code"), [(None, "CANCELLED"), (0.04, "DEADLINE_EXCEEDED")]
)
def test_a_caller_that_leaves_gives_the_room_back_and_is_counted_by_why(
    make_plane: Callable[..., Plane],
    ort_loaded: LoadedModel,
    deadline_in_s: float | None,
    code: str,
) -> None:
    """The transport cancels the handler when its caller goes away or its deadline
    passes; the time left tells which (``deadlines.departure``: within its slack of
    the deadline, the cancel is the deadline's)."""
    gated = HookedBackend(ort_loaded.backend, Gate(open=False))
    plane = make_plane(small=gated)

    async def body() -> None:
        try:
            # Held at the gate, computing; the next one queues behind it.
            held = asyncio.ensure_future(serve(plane, embed(large()), RecordingSink()))
            await entered(gated)
            deadline = None if deadline_in_s is None else time.monotonic() + deadline_in_s
            leaving = asyncio.ensure_future(
                plane.dataplane.serve(
                    FRONT_END, "Embed", EMBED, embed(tiny()), deadline, RecordingSink()
                )
            )
            while plane.handles["small"].scheduler.queued_tokens() != 8:
                await asyncio.sleep(0)
            assert plane.leases() == 2 and plane.calls.active == 2
            leaving.cancel()
            (outcome,) = await asyncio.gather(leaving, return_exceptions=True)
            assert isinstance(outcome, asyncio.CancelledError)
            # Its room and lease are back at once, while the first still computes.
            assert plane.leases() == 1 and plane.calls.active == 1
        finally:
            gated.gate.open()
        await held

    run(body(), plane)
    assert plane.observed.done == [("test.v1", "embed", "Embed", code, "small")]
    assert plane.observed.reasons == [code.lower()]
    assert plane.budget.inflight_bytes == 0 and plane.leases() == 0 and plane.calls.active == 0


def test_a_tiny_request_on_the_table_is_served_without_suspending(
    make_plane: Callable[..., Plane], small_loaded: LoadedModel, small_rows: np.ndarray
) -> None:
    plane = make_plane(small=small_loaded.backend)
    sink = RecordingSink()
    request = tiny()
    # No event loop at all: a step that suspended (a thread, a batch, the sink) would
    # hand back what it awaits instead of finishing.
    coroutine = serve(plane, embed(request), sink)
    with pytest.raises(StopIteration):
        coroutine.send(None)
    assert sink.sent == [reference(request, small_rows)]
    assert plane.budget.inflight_bytes == 0 and plane.leases() == 0
    asyncio.run(plane.handles["small"].scheduler.close())


# --- streams


async def requests_of(
    items: Sequence[Request[EmbedInput] | Refused], read: list[int] | None = None
) -> AsyncIterator[Request[EmbedInput] | Refused]:
    for item in items:
        if read is not None:
            read.append(1)
        yield item


def test_a_stream_answers_in_order_frames_failures_and_frees_each_answer_once_sent(
    make_plane: Callable[..., Plane],
    small_loaded: LoadedModel,
    ort_loaded: LoadedModel,
    small_rows: np.ndarray,
) -> None:
    """The first request is held computing on one model while the later ones, on another,
    are answered at once: they are sent after it all the same, in request order."""
    gated = HookedBackend(ort_loaded.backend, Gate(open=False))
    plane = make_plane(slow=gated, fast=small_loaded.backend)
    first = large()
    quick = [tiny(seed) for seed in range(3)]
    items: list[Request[EmbedInput] | Refused] = [
        embed(first, "slow"),
        embed(quick[0], "fast"),
        embed(rectangular([[SMALL_V + 5]]), "fast"),  # fails alone: an error answer
        Refused(InvalidInput("not a request")),
        embed(quick[1], "nope"),
        embed(quick[2], "fast"),
    ]
    sink = RecordingSink(hold=True)

    async def body() -> None:
        try:
            stream = asyncio.ensure_future(
                plane.dataplane.serve_stream(
                    FRONT_END, "EmbedStream", EMBED, requests_of(items), None, sink
                )
            )
            await entered(gated)
            # The fast ones are answered (framed) while the first is held, none sent.
            while len(sink.answers) < 2:
                await asyncio.sleep(0)
            assert sink.sent == []
        finally:
            gated.gate.open()
        await stream

    run(body(), plane)
    assert sink.sent == [
        reference(first, small_rows),
        reference(quick[0], small_rows),
        b"error:invalid_input",
        b"error:invalid_input",
        b"error:not_found",
        reference(quick[2], small_rows),
    ]
    # Each answer's room is held until its send is done; errors hold none.
    assert len(sink.pending) == 6
    assert plane.budget.inflight_bytes == sum(a.nbytes for a in sink.answers) > 0
    for sent in sink.pending:
        sent()
    assert plane.budget.inflight_bytes == 0 and plane.leases() == 0
    assert [(code, model) for *_, code, model in plane.observed.done] == [
        ("INVALID_INPUT", "fast"), ("INVALID_INPUT", ""), ("NOT_FOUND", ""),
    ]  # fmt: skip
    assert [(method, model) for _, _, method, model, *_ in plane.observed.served] == [
        ("EmbedStream", "fast"), ("EmbedStream", "fast"), ("EmbedStream", "slow"),
    ]  # fmt: skip
    assert plane.calls.active == 0


def test_a_stream_reads_no_further_ahead_than_its_window_while_an_answer_is_held(
    make_plane: Callable[..., Plane], ort_loaded: LoadedModel
) -> None:
    gated = HookedBackend(ort_loaded.backend, Gate(open=False))
    plane = make_plane(small=gated)
    total = 3 * STREAM_WINDOW
    items = [embed(large())] + [embed(tiny(n)) for n in range(total - 1)]
    read: list[int] = []
    sink = RecordingSink()

    async def body() -> None:
        try:
            stream = asyncio.ensure_future(
                plane.dataplane.serve_stream(
                    FRONT_END, "EmbedStream", EMBED, requests_of(items, read), None, sink
                )
            )
            await entered(gated)
            # The reader fills the window and waits; give it every turn it could use.
            for _ in range(10 * total):
                await asyncio.sleep(0)
            ahead = len(read)
            assert STREAM_WINDOW <= ahead <= STREAM_WINDOW + 2, ahead
            assert plane.calls.active == ahead
            assert sink.sent == []
        finally:
            gated.gate.open()
        await stream

    run(body(), plane)
    assert len(read) == total and len(sink.sent) == total
    assert plane.budget.inflight_bytes == 0 and plane.leases() == 0


@pytest.mark.parametrize("kind", ["table", "onnxruntime"])
def test_a_stream_item_whose_compute_fails_gives_its_room_and_lease_back_at_once(
    make_plane: Callable[..., Plane],
    small_loaded: LoadedModel,
    ort_loaded: LoadedModel,
    small_rows: np.ndarray,
    kind: str,
) -> None:
    """Items whose look-up fails (a tiny one, on the loop; a large one, off it) answer
    INTERNAL in the stream, which goes on; the room and the lease each one took are back
    before the next item is read, not only when the stream ends. The caller sends each
    item once the previous answer came, so that each compute is alone (no batch-mate of
    a poisoned item fails with it)."""
    poison = SMALL_V - 1
    spy = HookedBackend(
        small_loaded.backend if kind == "table" else ort_loaded.backend,
        fail_when=poisoned_by(poison),
    )
    plane = make_plane(small=spy)
    good_tiny = rectangular([[1, 2, 3]])
    good_large = rectangular(np.arange(2048).reshape(2, 1024) % (SMALL_V - 1))
    poisoned_large = rectangular(np.full((2, 1024), poison))
    items = [
        good_tiny,
        rectangular([[4, poison, 5]]),
        good_large,
        poisoned_large,
        good_tiny,
    ]
    sink = RecordingSink()
    between: list[tuple[int, int, int]] = []  # room, leases, calls when the next is read

    async def one_at_a_time() -> AsyncIterator[Request[EmbedInput] | Refused]:
        for index, item in enumerate(items):
            while len(sink.sent) < index:
                await asyncio.sleep(0.001)
            between.append((plane.budget.inflight_bytes, plane.leases(), plane.calls.active))
            yield embed(item)

    async def body() -> None:
        await plane.dataplane.serve_stream(
            FRONT_END, "EmbedStream", EMBED, one_at_a_time(), None, sink
        )

    run(body(), plane)
    assert sink.sent == [
        reference(good_tiny, small_rows),
        b"error:internal",
        reference(good_large, small_rows),
        b"error:internal",
        reference(good_tiny, small_rows),
    ]
    assert len(spy.calls) == len(items)  # each failure came from the backend's compute
    assert between == [(0, 0, 0)] * len(items)
    assert plane.budget.inflight_bytes == 0 and plane.leases() == 0 and plane.calls.active == 0
    assert [code for *_, code, _ in plane.observed.done] == ["INTERNAL", "INTERNAL"]


# --- answers about the models


def test_model_info_and_listings_come_from_the_repository_and_are_counted(
    make_plane: Callable[..., Plane], small_loaded: LoadedModel
) -> None:
    plane = make_plane(small=small_loaded.backend, other=small_loaded.backend)
    dataplane = plane.dataplane
    assert dataplane.model_info(FRONT_END, "Info", "") is plane.handles["small"].served
    assert dataplane.model_info(FRONT_END, "Info", "other", "1") is plane.handles["other"].served
    with pytest.raises(ModelNotFound):
        dataplane.model_info(FRONT_END, "Info", "nope")
    served, default = dataplane.list_models(FRONT_END, "List")
    assert [s.name for s in served] == ["small", "other"] and default == "small"
    plane.repository.drain()
    with pytest.raises(Unavailable, match="draining"):
        dataplane.list_models(FRONT_END, "List")
    assert plane.observed.done == [
        ("test.v1", "model_info", "Info", "OK", "small"),
        ("test.v1", "model_info", "Info", "OK", "other"),
        ("test.v1", "model_info", "Info", "NOT_FOUND", ""),
        ("test.v1", "list_models", "List", "OK", ""),
        ("test.v1", "list_models", "List", "UNAVAILABLE", ""),
    ]
    assert plane.calls.active == 0  # answered at once: nothing a drain waits for
