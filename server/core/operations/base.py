"""What an operation supplies to the scheduler, which is generic over them.

An operation (embed) reads what its request left unread (once what the request declares
fits the model) and turns it into a job (validation: a bad request fails here,
alone, before it could join a batch), says what the job costs (tokens for the queue bound,
output bytes for the process's budget), computes a batch of its jobs on a backend (any of
its jobs may share a batch), and shapes one job's result into an ``Answer``. It knows
nothing of protocols, placement or batching.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from tokembed.server.backends.base import Backend
from tokembed.server.core.served import ServedModel
from tokembed.server.core.types import Answer, Timings


class Job(Protocol):
    """A validated request, as the scheduler sees it."""

    @property
    def tokens(self) -> int:
        """What the model's queue bound counts (and the placement weighs)."""

    @property
    def output_bytes(self) -> int:
        """The bytes of its answer: what the process's output budget counts."""


class Costed:
    """A job of a heavy operation: admission bounds the queue by its work, not its tokens.
    A base class its jobs name, not a runtime-checkable Protocol: ``isinstance`` against
    one walks the protocol's members on every call, and every request's admission asks."""

    __slots__ = ()
    work: int  # its flops (nearest: ``2 N D V``)


RequestT = TypeVar("RequestT", contravariant=True)
JobT = TypeVar("JobT", bound=Job)
ResultT = TypeVar("ResultT")


class Operation(ABC, Generic[RequestT, JobT, ResultT]):
    name: str  # "embed": the `operation` label of the request metrics
    # A compute that multiplies over a whole table (nearest): it gains from company on
    # any backend, so its jobs always batch, and never compute on the event loop.
    heavy: bool = False
    # Its compute never runs on the event loop, whatever its size (a tokenizer's, whose
    # cost the request's size does not tell before it runs): each request on a worker
    # thread of its own, never batched with others.
    off_loop = False

    @abstractmethod
    def validate(self, request: RequestT, model: ServedModel) -> JobT:
        """The request as a job for ``model``; raises ``InvalidInput`` or ``TooLarge``
        naming the offending value."""

    def unread(self, request: RequestT) -> bool:
        """Whether some of the request's bytes are still where it left them (``read``)."""
        return False

    async def read(self, request: RequestT, model: ServedModel) -> RequestT:
        """The request with all its bytes in hand, read only once what it declares fits
        ``model``; raises ``InvalidInput`` or ``TooLarge`` (before reading anything)."""
        return request

    @abstractmethod
    def compute(self, backend: Backend, jobs: Sequence[JobT]) -> list[ResultT]:
        """Blocking: the results of ``jobs``, one each, in order (on whatever thread the
        scheduler placed the batch)."""

    @abstractmethod
    def answer(self, job: JobT, result: ResultT, timings: Timings, model: ServedModel) -> Answer:
        """One job's result as its answer (shape, dtype, pieces)."""
