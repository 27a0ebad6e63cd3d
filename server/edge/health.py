"""grpc.health.v1 on the gRPC port: grpc_health's servicer behind a size check, and what
it tells a caller without the bearer token.

Health is open without the token so that orchestrators can probe it, and its Watch never
ends by itself: so a request is refused by its size before it is decoded or kept, and a
caller without the token is told only the status of the names every deployment has (the
whole server, the protocol's service). Any other name, a model's included, is answered
to such a caller as a name that does not exist.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

HEALTH_SERVICE = "grpc.health.v1.Health"
CHECK = f"/{HEALTH_SERVICE}/Check"
WATCH = f"/{HEALTH_SERVICE}/Watch"
# A HealthCheckRequest is one service name: this leaves room for any name a deployment
# uses, and keeps what an open Watch can make the server hold small.
MAX_HEALTH_REQUEST_BYTES = 512

# grpc_health's messages carry no type information: Request and Response name them.
Request = Any
Response = Any
_RESPONSE = health_pb2.HealthCheckResponse
Answer = Callable[[Request, grpc.aio.ServicerContext], Awaitable[Response]]
Watcher = Callable[[Request, grpc.aio.ServicerContext], Awaitable[None]]


@dataclass(frozen=True)
class _Oversized:
    size: int


def _parse(raw: bytes) -> Request | _Oversized:
    if len(raw) > MAX_HEALTH_REQUEST_BYTES:
        return _Oversized(len(raw))
    return health_pb2.HealthCheckRequest.FromString(raw)


async def _refuse(request: _Oversized, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"health request of {request.size} bytes, over the limit of "
        f"{MAX_HEALTH_REQUEST_BYTES} bytes",
    )


class HealthFrontEnd:
    """``servicer`` (where the server sets each name's status) on the gRPC port."""

    def __init__(self, servicer: health.aio.HealthServicer, public: Iterable[str]) -> None:
        """``public``: the names a caller without the token may learn the status of."""
        self._servicer = servicer
        self._public = frozenset(public)

    def handler(self) -> grpc.GenericRpcHandler:
        """The health service, every name answered: for callers that may call the server."""
        return grpc.method_handlers_generic_handler(
            HEALTH_SERVICE,
            {
                "Check": self._unary(self._servicer.Check),
                "Watch": self._streaming(self._servicer.Watch),
            },
        )

    def unauthenticated(self) -> Mapping[str, grpc.RpcMethodHandler]:
        """By full method name, the handlers that answer a caller without the token."""
        return {
            CHECK: self._unary(self._check_public),
            WATCH: self._streaming(self._watch_public),
        }

    async def _check_public(self, request: Request, context: grpc.aio.ServicerContext) -> Response:
        if request.service in self._public:
            return await self._servicer.Check(request, context)
        # As grpc_health answers a name it does not know.
        await context.abort(grpc.StatusCode.NOT_FOUND)
        raise AssertionError("abort returned")  # This is a bug.

    async def _watch_public(self, request: Request, context: grpc.aio.ServicerContext) -> None:
        if request.service in self._public:
            await self._servicer.Watch(request, context)
            return
        # As grpc_health watches a name it does not know: SERVICE_UNKNOWN, then nothing
        # until the caller leaves (which cancels this).
        await context.write(_RESPONSE(status=_RESPONSE.SERVICE_UNKNOWN))
        await asyncio.Event().wait()

    @staticmethod
    def _unary(answer: Answer) -> grpc.RpcMethodHandler:
        async def check(
            request: Request | _Oversized, context: grpc.aio.ServicerContext
        ) -> Response:
            if isinstance(request, _Oversized):
                await _refuse(request, context)
            return await answer(request, context)

        return grpc.unary_unary_rpc_method_handler(
            check, request_deserializer=_parse, response_serializer=_RESPONSE.SerializeToString
        )

    @staticmethod
    def _streaming(answer: Watcher) -> grpc.RpcMethodHandler:
        async def watch(request: Request | _Oversized, context: grpc.aio.ServicerContext) -> None:
            if isinstance(request, _Oversized):
                await _refuse(request, context)
            await answer(request, context)

        return grpc.unary_stream_rpc_method_handler(
            watch, request_deserializer=_parse, response_serializer=_RESPONSE.SerializeToString
        )
