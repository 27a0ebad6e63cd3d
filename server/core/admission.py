"""Admission control: refuse at once what the server cannot hold, rather than queue it.

Three bounds, checked before a request can join a batch:
- tokens waiting in one model's batchers (queueing more only adds latency for everyone
  asking that model): per model;
- the work waiting in one model's batchers of an operation that multiplies over the whole
  table (nearest: ``2 N D V`` flops for N vectors, so that a vector counts for what it
  costs, millions of times a token's look-up): per model, instead of the token bound;
- output bytes of all admitted, unfinished requests of every model. An id costs 8 bytes
  in and D x 4 bytes out (256x at D=512), so this is what bounds the process's memory
  under a flood: one budget for the process (``OutputBudget``), shared by the models.
A refused request gets ``Overloaded`` (RESOURCE_EXHAUSTED) immediately.
"""

from __future__ import annotations

from collections.abc import Callable

from tokembed.server.core.errors import Overloaded


class OutputBudget:
    """Output bytes of every admitted, unfinished request in the process."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.inflight_bytes = 0


class Admission:
    """One model's admission: its queue bound, and the process's output budget."""

    def __init__(
        self,
        budget: OutputBudget,
        *,
        max_queued_tokens: int,
        queued_tokens: Callable[[], int],
        max_queued_work: int | None = None,
        queued_work: Callable[[], int] | None = None,
    ) -> None:
        """``queued_tokens``: the tokens of the light operations waiting; ``queued_work``:
        the flops of the heavy ones waiting (``max_queued_work`` bounds them)."""
        self._budget = budget
        self._max_queued_tokens = max_queued_tokens
        self._queued_tokens = queued_tokens
        self._max_queued_work = max_queued_work
        self._queued_work = queued_work

    @property
    def inflight_output_bytes(self) -> int:
        """Output bytes in flight in the whole process (every model's)."""
        return self._budget.inflight_bytes

    def admit(
        self,
        tokens: int,
        output_bytes: int,
        on_release: Callable[[], None] | None = None,
        *,
        work: int | None = None,
    ) -> Ticket:
        """Reserve room for one request or raise ``Overloaded``; release the ticket after.
        ``on_release``: called once, when the ticket is released (a model's lease).
        ``work``: a heavy request's flops, which the work bound counts instead of its
        tokens."""
        if work is not None:
            self._admit_work(work)
            return self._reserve(output_bytes, on_release)
        queued = self._queued_tokens()
        # A request alone in an empty queue is always admitted; otherwise one larger
        # than max_queued_tokens (but within max_tokens_per_request) would get
        # "overloaded, retry" forever.
        if queued and queued + tokens > self._max_queued_tokens:
            raise Overloaded(
                f"server overloaded: {queued} tokens queued, {tokens} more would pass the "
                f"limit of {self._max_queued_tokens}; retry with backoff"
            )
        return self._reserve(output_bytes, on_release)

    def _admit_work(self, work: int) -> None:
        if self._queued_work is None or self._max_queued_work is None:
            raise ValueError("this is a bug: a heavy request, and no bound on queued work")
        queued = self._queued_work()
        # As for tokens: a request alone in an empty queue is always admitted.
        if queued and queued + work > self._max_queued_work:
            raise Overloaded(
                f"server overloaded: {queued} flops of work queued, {work} more (2 x vectors "
                f"x D x V) would pass the limit of {self._max_queued_work}; retry with backoff"
            )

    def _reserve(self, output_bytes: int, on_release: Callable[[], None] | None) -> Ticket:
        budget = self._budget
        # Likewise one request alone is always admitted (per-request limits already bound
        # it), so a budget below one request's size cannot starve everybody.
        inflight = budget.inflight_bytes
        if inflight and inflight + output_bytes > budget.max_bytes:
            raise Overloaded(
                f"server overloaded: {inflight} output bytes in flight, "
                f"{output_bytes} more would pass the limit of {budget.max_bytes}; "
                "retry with backoff"
            )
        budget.inflight_bytes = inflight + output_bytes
        return Ticket(budget, output_bytes, on_release)


class Ticket:
    """Room held for one request; ``release`` is idempotent (done callbacks may race)."""

    __slots__ = ("_budget", "_on_release", "_output_bytes")

    def __init__(
        self,
        budget: OutputBudget,
        output_bytes: int,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self._budget: OutputBudget | None = budget
        self._output_bytes = output_bytes
        self._on_release = on_release

    def release(self, *_: object) -> None:
        """Give the room back (extra arguments are ignored, so that it can be a done
        callback as it is)."""
        budget = self._budget
        if budget is not None:
            self._budget = None
            budget.inflight_bytes -= self._output_bytes
            on_release, self._on_release = self._on_release, None
            # Let go of it too: gRPC may keep a finished call's callbacks (this ticket's
            # release among them) until its cyclic collector runs, and the lease's owner
            # is a model version, whose tables must go when it is unloaded.
            if on_release is not None:
                on_release()
