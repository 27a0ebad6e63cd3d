"""The end of the drain (server/app.py's stop_grpc): gRPC's stop gets the rest of the grace
while an RPC that a handler took is open, and is ended at once when none is.

gRPC here is a stand-in that stops as its documentation says (waits out the grace unless a
later call passes a shorter one): the case this guards against, calls gRPC holds but never
hands to a handler (grpc/grpc#41785), came once in ten loaded SIGTERM runs and cannot be
made on demand. The real server's drain is tests/e2e/test_lifecycle.py and
tests/reliability/test_faults.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from tokembed.server.app import DRAIN_QUIET_S, stop_grpc
from tokembed.server.edge.calls import Calls


class DocumentedStop:
    """grpc.aio.Server.stop as documented: waits until the grace is over (or until a later
    call with a shorter grace, None: at once), then the server is stopped."""

    def __init__(self) -> None:
        self.graces: list[float | None] = []
        self._stopped = asyncio.Event()

    async def stop(self, grace: float | None) -> None:
        self.graces.append(grace)
        if grace is None:
            self._stopped.set()
        try:
            await asyncio.wait_for(self._stopped.wait(), grace)
        except TimeoutError:
            self._stopped.set()


class Context:
    """What Calls.rpc_opened needs of a servicer context: its done callbacks."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[Any], None]] = []

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self.callbacks.append(callback)

    def end(self) -> None:
        for callback in self.callbacks:
            callback(self)


def _stop(
    calls: Calls, grace_s: float, during: Callable[[], Any] | None = None
) -> tuple[DocumentedStop, float]:
    async def scenario() -> tuple[DocumentedStop, float]:
        server = DocumentedStop()
        started = time.monotonic()
        stopping = asyncio.ensure_future(stop_grpc(server, calls, started + grace_s))  # type: ignore[arg-type]
        if during is not None:
            await during()
        await stopping
        return server, time.monotonic() - started

    return asyncio.run(scenario())


def test_nothing_open_stops_at_once_not_at_the_end_of_the_grace() -> None:
    server, took_s = _stop(Calls(None), grace_s=30)
    first = server.graces[0]
    assert first is not None and 29 < first <= 30  # the rest of the grace, first
    assert server.graces[1:] == [None]
    assert DRAIN_QUIET_S <= took_s < 2


def test_an_open_rpc_keeps_the_grace_until_it_ends() -> None:
    calls = Calls(None)
    context = Context()
    calls.rpc_opened(context)  # type: ignore[arg-type]

    async def end_it_later() -> None:
        await asyncio.sleep(1.0)
        assert calls.open_rpcs == 1
        context.end()

    server, took_s = _stop(calls, grace_s=30, during=end_it_later)
    assert calls.open_rpcs == 0
    assert server.graces[1:] == [None]  # once it ended, and not before
    assert 1.0 <= took_s < 3  # no new RPC for DRAIN_QUIET_S already: at once


def test_an_rpc_still_open_at_the_end_of_the_grace_is_left_to_grpc() -> None:
    calls = Calls(None)
    calls.rpc_opened(Context())  # type: ignore[arg-type]
    server, took_s = _stop(calls, grace_s=0.5)
    assert len(server.graces) == 1  # no early stop: gRPC's own grace ran out
    assert 0.5 <= took_s < 2
