"""The end of ``tokembed serve``'s loop (server/app.py's let_tasks_end): what is still
finishing after the drain ends by itself, before asyncio.run cancels what is left.

A real gRPC server shows the case: a handler that has sent its status is still running
when gRPC's stop returns (grpc/grpc#37239). ``tokembed serve`` itself is stopped by
SIGTERM in tests/reliability/test_faults.py, which checks that its log has no traceback.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import pytest

from tokembed.server.app import let_tasks_end


def test_a_handler_still_running_after_grpcs_stop_ends_before_the_loop_does() -> None:
    events: list[str] = []

    async def scenario() -> set[asyncio.Task[Any]]:
        release = asyncio.Event()

        async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
            finally:
                # Its status is sent: gRPC's core holds no open call, this task runs on.
                await release.wait()
                events.append("handler ended")

        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "t.S", {"M": grpc.unary_unary_rpc_method_handler(handler)}
                )
            ]
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await channel.unary_unary("/t.S/M")(b"x", timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # Let the handler go some loop turns after the stop, which does not wait for it.
        asyncio.get_running_loop().call_later(0.2, release.set)
        await server.stop(5)
        events.append("gRPC stopped")
        await let_tasks_end(30)
        events.append("tasks ended")
        return {task for task in asyncio.all_tasks() if task is not asyncio.current_task()}

    left = asyncio.run(scenario())
    assert left == set()
    # The handler ended by itself (not cancelled), before the loop's end.
    assert "handler ended" in events, events
    assert events.index("handler ended") < events.index("tasks ended"), events


def test_a_task_that_never_ends_is_waited_for_no_longer_than_the_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> bool:
        forever = asyncio.ensure_future(asyncio.Event().wait())
        forever.set_name("never-ends")
        # Ends it in any case, so that a wait past the bound ends the test, failing it.
        asyncio.get_running_loop().call_later(30, forever.cancel)
        with caplog.at_level(logging.WARNING, logger="tokembed.server.app"):
            await let_tasks_end(0.05)
        running = not forever.done()
        forever.cancel()
        return running

    assert asyncio.run(scenario()), "it waited past its bound"
    assert "1 tasks still running at the end: ['never-ends']" in caplog.text
