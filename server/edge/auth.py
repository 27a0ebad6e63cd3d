"""Optional bearer-token authentication, as a server interceptor; and who a call comes
from (``Identities``), as far as authentication can tell.

Every RPC must carry ``authorization: Bearer <token>``; the token is compared in
constant time. The methods given as open (health, so that orchestrators can probe) answer a
caller without it through the handlers given for them (edge/health: the overall status
alone).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

import grpc

from tokembed.server.core.errors import ServerConfigError
from tokembed.server.edge.status_codes import REASON_METADATA_KEY


def presented_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> bytes:
    """The ``authorization`` metadata a call presented, as bytes (b"" when none)."""
    for key, value in metadata or ():
        if key == "authorization":
            return value.encode("utf-8") if isinstance(value, str) else value
    return b""


def read_token(path: Path, setting: str = "auth_token_file") -> bytes:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ServerConfigError(f"cannot read {setting} {path}: {exc}") from exc
    if not token:
        raise ServerConfigError(f"{setting} {path} is empty")
    return token.encode("utf-8")


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(
        self,
        token: bytes,
        on_reject: Callable[[str], None] | None = None,
        open_methods: Mapping[str, grpc.RpcMethodHandler] | None = None,
        skipped: Sequence[str] = (),
    ) -> None:
        """``on_reject(method)``: told of each refused call, by its full method name
        ("/tokembed.v1.EmbeddingService/Embed"); ``open_methods``: by full method name,
        the handler that answers a call without the token instead of refusing it;
        ``skipped``: methods another credential is checked for (``control_access``)."""
        self._expected = b"Bearer " + token
        self._skipped = frozenset(skipped)
        self._on_reject = on_reject
        self._open = dict(open_methods or {})

        async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong bearer token (metadata 'authorization: Bearer <token>')",
                trailing_metadata=((REASON_METADATA_KEY, "unauthenticated"),),
            )

        # One refusal per call shape: gRPC needs the handler to match the method's.
        self._deny = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny),
            (True, False): grpc.stream_unary_rpc_method_handler(deny),
            (True, True): grpc.stream_stream_rpc_method_handler(deny),
        }

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method in self._skipped:
            return await continuation(details)
        if hmac.compare_digest(presented_token(details.invocation_metadata), self._expected):
            return await continuation(details)
        if details.method in self._open:
            return self._open[details.method]
        handler = await continuation(details)
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return handler
        if self._on_reject is not None:
            self._on_reject(details.method)
        return self._deny[(bool(handler.request_streaming), bool(handler.response_streaming))]


# The identity of every caller when the server tells none apart (no client certificates,
# no token): what is registered is everyone's, as in Triton.
ANYONE = "anyone"
_CERTIFICATE = "x509_pem_cert"  # gRPC's auth context: the peer's verified certificate


class Identities:
    """Who a call comes from, as an opaque key (the shared-memory registry keeps regions
    by it): the client certificate when mutual TLS is on (each certificate its own
    identity, even two of one name from one CA); else the bearer token when one is set;
    else ``ANYONE``. Keys are SHA-256 digests: the token itself is not kept."""

    def __init__(self, *, client_certificates: bool, token: bool) -> None:
        self._certificates = client_certificates
        self._token = token

    def of(self, context: grpc.aio.ServicerContext) -> str:
        if self._certificates:
            certificate = context.auth_context().get(_CERTIFICATE)
            if certificate:
                return "certificate:" + hashlib.sha256(certificate[0]).hexdigest()
        if self._token:
            presented = presented_token(context.invocation_metadata())
            if presented:  # the interceptor let only the token's through
                return "token:" + hashlib.sha256(presented).hexdigest()
        return ANYONE
