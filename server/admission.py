"""Admission control: refuse at once what the server cannot hold, rather than queue it.

Two bounds, both checked before a request joins the batcher:
- tokens waiting for a batch (queueing more only adds latency for everyone);
- output bytes of all admitted, unfinished requests. An id costs 8 bytes in and D x 4
  bytes out (256x at D=512), so this is what bounds the server's memory under a flood.
A refused request gets ``Overloaded`` (RESOURCE_EXHAUSTED) immediately.
"""

from __future__ import annotations

from collections.abc import Callable

from tokembed.server.errors import Overloaded


class Admission:
    def __init__(
        self,
        *,
        max_queued_tokens: int,
        max_inflight_output_bytes: int,
        queued_tokens: Callable[[], int],
    ) -> None:
        self._max_queued_tokens = max_queued_tokens
        self._max_inflight_bytes = max_inflight_output_bytes
        self._queued_tokens = queued_tokens
        self._inflight_bytes = 0

    @property
    def inflight_output_bytes(self) -> int:
        return self._inflight_bytes

    def admit(self, tokens: int, output_bytes: int) -> Ticket:
        """Reserve room for one request or raise ``Overloaded``; release the ticket after."""
        queued = self._queued_tokens()
        # Fix: as for bytes below, a request alone in an empty queue is always admitted;
        # otherwise one larger than max_queued_tokens (but within max_tokens_per_request)
        # got "overloaded, retry" forever.
        if queued and queued + tokens > self._max_queued_tokens:
            raise Overloaded(
                f"server overloaded: {queued} tokens queued, {tokens} more would pass the "
                f"limit of {self._max_queued_tokens}; retry with backoff"
            )
        # One request alone is always admitted (per-request limits already bound it),
        # so a limit below one request's size cannot starve everybody.
        if self._inflight_bytes and self._inflight_bytes + output_bytes > self._max_inflight_bytes:
            raise Overloaded(
                f"server overloaded: {self._inflight_bytes} output bytes in flight, "
                f"{output_bytes} more would pass the limit of {self._max_inflight_bytes}; "
                "retry with backoff"
            )
        self._inflight_bytes += output_bytes
        return Ticket(self, output_bytes)

    def _release(self, output_bytes: int) -> None:
        self._inflight_bytes -= output_bytes


class Ticket:
    """Room held for one request; ``release`` is idempotent (done callbacks may race)."""

    def __init__(self, admission: Admission, output_bytes: int) -> None:
        self._admission = admission
        self._output_bytes = output_bytes
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release(self._output_bytes)
