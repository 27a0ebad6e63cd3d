"""What the gRPC edge knows about the server as a whole: which service answers (none
while the model loads), whether it is draining, and how many calls are in flight."""

from __future__ import annotations

import asyncio
import time

from tokembed.server.errors import Unavailable
from tokembed.server.service import EmbeddingService


class ServingState:
    """Which service answers (None while the model loads) and whether we are draining."""

    def __init__(self) -> None:
        self.service: EmbeddingService | None = None
        self.draining = False
        self.active_requests = 0
        self.last_call_at = 0.0  # time.monotonic() of the latest call to reach a handler
        self._idle: asyncio.Event | None = None

    def enter(self) -> None:
        """Count a request as in flight, so draining can wait for it."""
        self.active_requests += 1

    def leave(self) -> None:
        self.active_requests -= 1
        if self.active_requests == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False if ``timeout_s`` passed first."""
        if self.active_requests == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=timeout_s)
        except TimeoutError:
            return False
        return True

    async def wait_quiet(self, quiet_s: float, since: float, until: float) -> None:
        """Wait until no call has reached a handler for ``quiet_s`` (counting from
        ``since`` at the earliest), or until ``until``."""
        while (now := time.monotonic()) < until:
            idle = now - max(self.last_call_at, since)
            if idle >= quiet_s:
                return
            await asyncio.sleep(min(quiet_s - idle, until - now))

    def ready_service(self) -> EmbeddingService:
        self.last_call_at = time.monotonic()
        if self.draining:
            raise Unavailable("the server is draining; retry on another replica")
        if self.service is None:
            raise Unavailable("the model is still loading; retry shortly")
        return self.service


class InFlight:
    """Counts one request as in flight (for draining, and the gauge that reads the count);
    a plain class because a generator-based context manager costs ~30 us per request."""

    __slots__ = ("_state",)

    def __init__(self, state: ServingState) -> None:
        self._state = state

    def __enter__(self) -> None:
        self._state.enter()

    def __exit__(self, *exc_info: object) -> None:
        self._state.leave()
