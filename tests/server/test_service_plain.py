"""The plain path (``EmbeddingService.embed_plain``): the commonest request gets what
``embed`` gives it, and every other request is left to ``embed`` with nothing done."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tokembed.server.app import LoadedModel
from tokembed.server.domain import EmbedInput
from tokembed.server.errors import Internal
from tokembed.server.row_bytes import RowBytes, int64_values
from tokembed.server.service import OFFLOAD_MIN_BYTES, EmbeddingService, PlainAnswer
from tokembed.server.settings import Settings

from support.fixtures import SMALL_D, SMALL_V
from support.observers import BatchRecorder


def _counts(batches: BatchRecorder) -> list[tuple[int, int]]:
    """The batches reported, as (requests, tokens)."""
    return [(requests, tokens) for requests, tokens, _ in batches.done]


def make_service(
    small_loaded: LoadedModel,
    observer: BatchRecorder,
    compute: Callable[[np.ndarray], np.ndarray] | None = None,
    *,
    table: bool = True,
    **settings: Any,
) -> EmbeddingService:
    """``table``: whether the service has the float32 table (the plain path answers from
    it; without it, from ``compute``)."""
    return EmbeddingService(
        small_loaded.model, compute or small_loaded.runtime.run, small_loaded.runtime.provider,
        Settings(model_dir=small_loaded.model.path, **settings), observer=observer,
        pad_row=small_loaded.pad_row,
        float32_table=small_loaded.float32_table if table else None,
    )  # fmt: skip


def answer_array(answer: PlainAnswer) -> np.ndarray:
    """The plain answer's rows as the array their bytes are."""
    joined = b"".join(answer.pieces)
    return np.frombuffer(joined, dtype="<f4").reshape(answer.shape)


def ids_input(ids: np.ndarray) -> EmbedInput:
    return EmbedInput(ids_dtype="int64", shape=tuple(ids.shape), data=ids.astype("<i8").tobytes())


@pytest.mark.parametrize("table", [True, False], ids=["from the table", "from compute"])
@pytest.mark.parametrize("shape", [(1, 1), (1, 8), (3, 5), (4, 64)])
def test_the_plain_path_answers_what_embed_answers(
    small_loaded: LoadedModel, small_rows: np.ndarray, shape: tuple[int, int], table: bool
) -> None:
    ids = np.random.default_rng(sum(shape)).integers(0, SMALL_V, shape)
    plain_batches, general_batches = BatchRecorder(), BatchRecorder()
    plain_service = make_service(small_loaded, plain_batches, table=table)
    general_service = make_service(small_loaded, general_batches, table=table)

    async def go() -> None:
        try:
            plain = plain_service.embed_plain(ids.astype("<i8").tobytes(), *shape, None)
            assert plain is not None
            general, general_ticket = await general_service.embed(ids_input(ids), None)
            # The same room held until the answer is sent.
            held = plain_service.admission.inflight_output_bytes
            assert held == general_service.admission.inflight_output_bytes == ids.size * SMALL_D * 4
            plain.ticket.release()
            general_ticket.release()
            assert plain_service.admission.inflight_output_bytes == 0
        finally:
            await plain_service.close()
            await general_service.close()
        assert plain.shape == (*shape, SMALL_D)
        np.testing.assert_array_equal(answer_array(plain), small_rows[ids])
        np.testing.assert_array_equal(answer_array(plain), general.hidden_states)
        assert general.lengths is None
        for timings in (plain.timings, general.timings):
            assert (timings.queue_s, timings.batch_requests, timings.batch_tokens) == (
                0.0, 1, ids.size,
            )  # fmt: skip
            assert timings.compute_s > 0
        # One batch of one request, reported once, as embed() reports it.
        assert _counts(plain_batches) == _counts(general_batches) == [(1, ids.size)]

    asyncio.run(go())


def _declined(
    service: EmbeddingService, ids: bytes, batch: int, seq_len: int, deadline: float | None = None
) -> bool:
    held = service.admission.inflight_output_bytes
    served = service.embed_plain(ids, batch, seq_len, deadline)
    # Nothing done: no room taken, and (checked by the caller) no look-up reported.
    assert service.admission.inflight_output_bytes == held
    return served is None


def _ids(*shape: int, high: int = SMALL_V) -> bytes:
    return np.random.default_rng(7).integers(0, high, shape).astype("<i8").tobytes()


IN_PLACE_TOKENS = OFFLOAD_MIN_BYTES // (SMALL_D * 4)  # the smallest answer embed() writes in place
DECLINED: dict[str, tuple[Callable[[], tuple[bytes, int, int]], dict[str, Any]]] = {
    "an id past the vocabulary": (lambda: (_ids(1, 7) + _le(SMALL_V), 1, 8), {}),
    "a negative id": (lambda: (_le(-1) + _ids(1, 7), 1, 8), {}),
    "an empty batch": (lambda: (b"", 0, 8), {}),
    "two negative dimensions": (lambda: (_ids(1, 8), -1, -8), {}),
    "fewer id bytes than the shape needs": (lambda: (_ids(1, 7), 1, 8), {}),
    "more tokens than are looked up inline": (
        lambda: (_ids(1, 9), 1, 9), {"inline_compute_max_tokens": 8},
    ),
    "more tokens than a request may have": (
        lambda: (_ids(2, 8), 2, 8), {"max_tokens_per_request": 15},
    ),
    "an answer over the per-request limit": (
        lambda: (_ids(1, 8), 1, 8), {"max_output_bytes_per_request": 8 * SMALL_D * 4 - 1},
    ),
    "an answer embed() writes in place": (
        lambda: (_ids(1, IN_PLACE_TOKENS), 1, IN_PLACE_TOKENS),
        {"inline_compute_max_tokens": 1 << 20},
    ),
}  # fmt: skip


def _le(value: int) -> bytes:
    return np.array([value], dtype="<i8").tobytes()


@pytest.mark.parametrize("case", sorted(DECLINED))
def test_anything_else_is_left_to_embed_with_nothing_done(
    small_loaded: LoadedModel, case: str
) -> None:
    make_request, settings = DECLINED[case]
    batches = BatchRecorder()
    service = make_service(small_loaded, batches, **settings)
    try:
        assert _declined(service, *make_request())
    finally:
        asyncio.run(service.close())
    assert batches.done == []


def test_a_draining_service_leaves_it_to_embed(small_loaded: LoadedModel) -> None:
    batches = BatchRecorder()
    service = make_service(small_loaded, batches)
    service.draining = True
    try:
        assert _declined(service, _ids(1, 8), 1, 8)
    finally:
        asyncio.run(service.close())
    assert batches.done == []


def test_a_passed_deadline_leaves_it_to_embed(small_loaded: LoadedModel) -> None:
    batches = BatchRecorder()
    service = make_service(small_loaded, batches)
    try:
        assert _declined(service, _ids(1, 8), 1, 8, deadline=time.monotonic() - 1)
    finally:
        asyncio.run(service.close())
    assert batches.done == []


def test_an_overloaded_service_leaves_it_to_embed(small_loaded: LoadedModel) -> None:
    batches = BatchRecorder()
    service = make_service(small_loaded, batches, max_inflight_output_bytes=8 * SMALL_D * 4)
    held = service.admission.admit(8, 8 * SMALL_D * 4)  # the server is full
    try:
        assert _declined(service, _ids(1, 8), 1, 8)
    finally:
        held.release()
        asyncio.run(service.close())
    assert batches.done == []


def test_a_busy_batcher_leaves_it_to_embed(
    small_loaded: LoadedModel, small_rows: np.ndarray
) -> None:
    """Without a table, while a batch computes a small request queues to join the next
    one (embed())."""
    started, release = threading.Event(), threading.Event()

    def slow_compute(ids: np.ndarray) -> np.ndarray:
        started.set()
        release.wait(10)
        return small_loaded.runtime.run(ids)

    batches = BatchRecorder()
    service = make_service(
        small_loaded, batches, slow_compute, table=False, inline_compute_max_tokens=8
    )
    big = np.arange(16, dtype=np.int64).reshape(1, 16)  # past inline: computed in a thread

    async def go() -> None:
        try:
            computing = asyncio.ensure_future(service.embed(ids_input(big), None))
            while not started.is_set():
                await asyncio.sleep(0.001)
            assert _declined(service, _ids(1, 8), 1, 8)
            release.set()
            output, ticket = await computing
            ticket.release()
            np.testing.assert_array_equal(output.hidden_states, small_rows[big])
        finally:
            release.set()
            await service.close()

    asyncio.run(go())
    assert _counts(batches) == [(1, 16)]  # the big one only


def test_a_failing_look_up_gives_the_room_back(small_loaded: LoadedModel) -> None:
    def broken_compute(ids: np.ndarray) -> np.ndarray:
        raise RuntimeError("the table exploded")

    batches = BatchRecorder()
    service = make_service(small_loaded, batches, broken_compute, table=False)
    try:
        with pytest.raises(Internal, match="the table exploded"):
            service.embed_plain(_ids(1, 8), 1, 8, None)
        assert service.admission.inflight_output_bytes == 0
    finally:
        asyncio.run(service.close())
    assert batches.done == []


def test_with_a_table_the_rows_come_from_it_whatever_the_batcher_does(
    small_loaded: LoadedModel, small_rows: np.ndarray
) -> None:
    """The table is the look-up: no compute is called, even while the batcher is busy,
    and the answer counts as a batch of one, as embed() counts its own table gathers."""

    def no_compute(ids: np.ndarray) -> np.ndarray:
        raise AssertionError("the plain path must answer from the table")

    batches = BatchRecorder()
    service = make_service(small_loaded, batches, no_compute)
    service.batcher._computing = 1  # as while a batch computes on a thread
    ids = np.array([[3, 1, 4, 1, 5]], dtype=np.int64)
    try:
        answer = service.embed_plain(ids.tobytes(), 1, 5, None)
        assert answer is not None
        np.testing.assert_array_equal(answer_array(answer), small_rows[ids])
        answer.ticket.release()
    finally:
        service.batcher._computing = 0
        asyncio.run(service.close())
    assert _counts(batches) == [(1, 5)]


def test_the_look_up_must_give_one_row_of_d_per_id(small_loaded: LoadedModel) -> None:
    """Without a table: rows of another width would not fit the answer's header."""
    batches = BatchRecorder()
    service = make_service(
        small_loaded, batches, lambda ids: np.zeros((ids.size, SMALL_D + 1), np.float32),
        table=False,
    )  # fmt: skip
    try:
        with pytest.raises(Internal, match="rows of shape"):
            service.embed_plain(_ids(1, 8), 1, 8, None)
        assert service.admission.inflight_output_bytes == 0
    finally:
        asyncio.run(service.close())


def test_row_bytes_are_the_table_rows_and_ids_read_as_sent() -> None:
    table = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)
    rows = RowBytes(table)
    ids = [4, 0, 0, 2]
    assert b"".join(rows.rows(ids)) == table[ids].tobytes()
    wire_ids = np.array([7, -1, 2**62, 0], dtype="<i8").tobytes()
    assert int64_values(wire_ids) == [7, -1, 2**62, 0]
    with pytest.raises(ValueError, match="C-contiguous"):
        RowBytes(np.asfortranarray(table))
