"""Who may load and unload models: the control methods (V2's repository extension) take
a credential of their own, ``--control-token-file``, distinct from the data token; a
caller that may embed may not, for that alone, change what is served.

Without a control token, control is refused unless the server listens on loopback only
(then whoever can reach the port is on this host, and the data token, if any, applies as
to any method). With one, a control call must present ``authorization: Bearer <control
token>``, compared in constant time; the data token is not checked for it.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Sequence

import grpc

from tokembed.server.edge.auth import presented_token
from tokembed.server.edge.status_codes import REASON_METADATA_KEY


def is_loopback(host: str) -> bool:
    """Whether ``host`` (the gRPC bind address) is reachable from this host alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ControlAccessInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(
        self,
        methods: Sequence[str],
        *,
        token: bytes | None,
        loopback_only: bool,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        """``methods``: the control methods, by full name; ``token``: the control token
        (None: none set); ``loopback_only``: the server listens on loopback alone."""
        self._methods = frozenset(methods)
        self._expected = None if token is None else b"Bearer " + token
        self._loopback_only = loopback_only
        self._on_reject = on_reject

        def refusal(code: grpc.StatusCode, message: str, reason: str) -> grpc.RpcMethodHandler:
            async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
                await context.abort(
                    code, message, trailing_metadata=((REASON_METADATA_KEY, reason),)
                )

            return grpc.unary_unary_rpc_method_handler(deny)

        self._wrong_token = refusal(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong control token: load, unload and the repository index take "
            "the token of --control-token-file (metadata 'authorization: Bearer <token>')",
            "unauthenticated",
        )
        self._no_control = refusal(
            grpc.StatusCode.PERMISSION_DENIED,
            "model control is refused: the server listens beyond loopback and has no "
            "--control-token-file (start it with one to load and unload models remotely)",
            "control_refused",
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method not in self._methods:
            return await continuation(details)
        if self._expected is None:
            if self._loopback_only:
                return await continuation(details)
            return self._refuse(details.method, self._no_control)
        if hmac.compare_digest(presented_token(details.invocation_metadata), self._expected):
            return await continuation(details)
        return self._refuse(details.method, self._wrong_token)

    def _refuse(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if self._on_reject is not None:
            self._on_reject(method)
        return handler
