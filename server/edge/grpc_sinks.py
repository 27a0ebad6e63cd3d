"""How a gRPC front end hands a framed answer to gRPC: the sinks every protocol's unary
and stream methods build on (each protocol frames its answers; these send them)."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from tokembed.server.core.dataplane import Sink, StreamSink


class GrpcUnarySink(Sink[bytes]):
    """A unary answer of a gRPC front end (each protocol says how it is framed): the
    handler returns ``payload``; its bytes are gone when the RPC ends (gRPC's documented
    done callback), sent or not."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self.payload = b""

    async def send(self, framed: bytes, sent: Callable[[], None]) -> None:
        self.payload = framed
        self._context.add_done_callback(lambda _context: sent())


class GrpcStreamItemSink(StreamSink[bytes]):
    """A gRPC stream's answers (or a request's error), each as the stream's next message
    (each protocol says how they are framed)."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    async def send(self, framed: bytes, sent: Callable[[], None]) -> None:
        try:
            await self._context.write(framed)
        finally:
            sent()
