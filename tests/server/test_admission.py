"""Admission control: refuse at once what the server cannot hold."""

from __future__ import annotations

import pytest

from tokembed.server.core.admission import Admission, OutputBudget
from tokembed.server.core.errors import Overloaded


class Queue:
    """Stands in for the batcher's queued-token count."""

    def __init__(self) -> None:
        self.tokens = 0


def admission(
    queue: Queue,
    *,
    max_queued_tokens: int = 100,
    max_bytes: int = 1000,
    budget: OutputBudget | None = None,
) -> Admission:
    return Admission(
        budget if budget is not None else OutputBudget(max_bytes),
        max_queued_tokens=max_queued_tokens,
        queued_tokens=lambda: queue.tokens,
    )


def test_queued_tokens_limit_refuses_at_once_and_names_the_numbers() -> None:
    queue = Queue()
    gate = admission(queue)
    queue.tokens = 90
    gate.admit(10, 1).release()  # exactly at the limit is fine
    with pytest.raises(Overloaded) as error:
        gate.admit(11, 1)
    message = str(error.value)
    assert "90 tokens queued" in message and "11 more" in message and "limit of 100" in message
    assert "retry" in message
    assert gate.inflight_output_bytes == 0  # a refusal reserves nothing
    queue.tokens = 0
    gate.admit(11, 1).release()  # the queue drained: admitted again


def test_inflight_output_bytes_are_reserved_until_released() -> None:
    gate = admission(Queue(), max_bytes=1000)
    first = gate.admit(1, 600)
    second = gate.admit(1, 400)
    assert gate.inflight_output_bytes == 1000
    with pytest.raises(Overloaded, match=r"1000 output bytes in flight, 1 more .* limit of 1000"):
        gate.admit(1, 1)
    first.release()
    assert gate.inflight_output_bytes == 400
    third = gate.admit(1, 600)
    assert gate.inflight_output_bytes == 1000
    second.release()
    third.release()
    assert gate.inflight_output_bytes == 0


def test_release_is_idempotent() -> None:
    gate = admission(Queue())
    keep = gate.admit(1, 300)
    ticket = gate.admit(1, 200)
    ticket.release()
    ticket.release()
    assert gate.inflight_output_bytes == 300
    keep.release()
    assert gate.inflight_output_bytes == 0


def test_one_request_alone_is_admitted_even_over_the_byte_limit() -> None:
    gate = admission(Queue(), max_bytes=1000)
    big = gate.admit(1, 5000)
    assert gate.inflight_output_bytes == 5000
    with pytest.raises(Overloaded):
        gate.admit(1, 1)
    big.release()
    gate.admit(1, 5000).release()


def test_one_request_alone_is_admitted_even_over_the_queued_token_limit() -> None:
    # A request within the per-request limits but larger than max_queued_tokens must
    # not be refused as "overloaded, retry" forever when nothing is queued.
    queue = Queue()
    gate = admission(queue, max_queued_tokens=100)
    gate.admit(500, 1).release()
    queue.tokens = 1
    with pytest.raises(Overloaded):
        gate.admit(500, 1)


def test_models_share_the_process_s_output_budget_but_not_their_queues() -> None:
    budget = OutputBudget(1000)
    encoder_queue, decoder_queue = Queue(), Queue()
    encoder = admission(encoder_queue, budget=budget, max_queued_tokens=10)
    decoder = admission(decoder_queue, budget=budget, max_queued_tokens=10)
    held = encoder.admit(1, 700)
    with pytest.raises(Overloaded, match="700 output bytes in flight"):
        decoder.admit(1, 400)  # the other model's answers count too
    decoder.admit(1, 300).release()
    encoder_queue.tokens = 10  # the encoder's queue is full; the decoder's is not
    with pytest.raises(Overloaded, match="10 tokens queued"):
        encoder.admit(1, 1)
    decoder.admit(5, 1).release()
    held.release()
    assert budget.inflight_bytes == 0


def test_heavy_requests_are_bounded_by_their_work_not_their_tokens() -> None:
    """nearest's queue bound counts flops (2 N D V): a request of few vectors but much
    work is refused where tokens would have let it in, and the token bound is not asked."""
    queue = Queue()
    work = {"queued": 0}
    gate = Admission(
        OutputBudget(1000), max_queued_tokens=100, queued_tokens=lambda: queue.tokens,
        max_queued_work=10_000, queued_work=lambda: work["queued"],
    )  # fmt: skip
    queue.tokens = 100  # the token queue is full: a heavy request does not count it
    gate.admit(1, 1, work=10_000).release()  # alone in an empty work queue: admitted
    work["queued"] = 6_000
    gate.admit(1, 1, work=4_000).release()  # exactly at the limit is fine
    with pytest.raises(Overloaded) as error:
        gate.admit(1, 1, work=4_001)  # one vector, but its work is past the bound
    message = str(error.value)
    assert "6000 flops of work queued" in message and "4001 more" in message
    assert "limit of 10000" in message and "retry" in message
    assert gate.inflight_output_bytes == 0
    with pytest.raises(Overloaded, match="100 tokens queued"):
        gate.admit(1, 1)  # a light request still meets the token bound
