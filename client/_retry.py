"""A call's retries and its deadline, shared by the sync and asyncio clients.

Not gRPC's own retry policy (a channel's service config): it retries by status code
alone, and RESOURCE_EXHAUSTED is both too_large (never retried) and overloaded (retried
when asked), told apart only by the reason in the trailing metadata.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from tokembed.client.errors import (
    EmbeddingError,
    OverloadedError,
    RequestCancelledError,
    UnavailableError,
)

DEFAULT_RETRIES = 3
DEFAULT_BACKOFF_S = 0.1
DEFAULT_BACKOFF_MAX_S = 2.0


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff and jitter.

    Retried: UNAVAILABLE always (Embed is a pure look-up, so repeating it is safe);
    CANCELLED from the server (a server stopping under load cancels a call now and then,
    a race inside gRPC: treated like UNAVAILABLE, as docs/security.md advises; never a
    call the caller cancelled: closing the client, or cancelling an asyncio task, is not
    retried); and RESOURCE_EXHAUSTED/overloaded when ``retry_on_overload``; never
    too_large or others.
    The n-th retry waits a random time in [d/2, d], d = min(backoff_max_s, backoff_s·2^n):
    exponential growth, and jitter so that many clients do not retry in lock-step.
    """

    retries: int = DEFAULT_RETRIES
    backoff_s: float = DEFAULT_BACKOFF_S
    backoff_max_s: float = DEFAULT_BACKOFF_MAX_S
    retry_on_overload: bool = False

    def should_retry(self, error: EmbeddingError, attempts_made: int) -> bool:
        if attempts_made > self.retries:
            return False
        if isinstance(error, (UnavailableError, RequestCancelledError)):
            return True
        return self.retry_on_overload and isinstance(error, OverloadedError)

    def delay_s(self, retry_index: int) -> float:
        ceiling = min(self.backoff_max_s, self.backoff_s * (2.0**retry_index))
        return random.uniform(ceiling / 2, ceiling)


class Deadline:
    """One call's overall deadline, shared by all its attempts and the sleeps between."""

    def __init__(self, timeout_s: float | None) -> None:
        self._end = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining_s(self) -> float | None:
        """Seconds left (never negative), or None for no deadline."""
        if self._end is None:
            return None
        return max(0.0, self._end - time.monotonic())

    def allows_sleep(self, seconds: float) -> bool:
        """True if sleeping ``seconds`` still leaves time for another attempt."""
        return self._end is None or time.monotonic() + seconds < self._end


def give_up(error: EmbeddingError, attempts: int) -> EmbeddingError:
    """Record the number of attempts on the error that ends the call."""
    error.attempts = attempts
    if attempts > 1:
        error.args = (f"{error.args[0]} (gave up after {attempts} attempts)", *error.args[1:])
    return error
