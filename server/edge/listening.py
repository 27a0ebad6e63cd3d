"""What must hold before the server binds: the port free, the TLS files parsing. Each
failure is a ServerConfigError, one line naming the thing and what to do, rather than
gRPC's own bind error or log line."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import grpc

from tokembed.server.core.errors import ServerConfigError


def check_port_free(host: str, port: int) -> None:
    """Raise ``ServerConfigError`` if ``host:port`` cannot be bound (in use, say)."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ServerConfigError(f"cannot listen on {host}:{port}: {exc}; check --host") from exc
    for family, kind, proto, _, where in addresses:
        with socket.socket(family, kind, proto) as probe:
            # As gRPC binds: a port left in TIME_WAIT by a previous server is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(where)
            except OSError as exc:
                raise ServerConfigError(
                    f"cannot listen on {host}:{port}: {exc.strerror or exc}; stop what "
                    "listens there or choose another --port (0 picks a free one)"
                ) from exc


def tls_credentials(
    tls_cert: Path | None, tls_key: Path | None, tls_client_ca: Path | None
) -> grpc.ServerCredentials | None:
    """The server's TLS credentials (none without ``tls_cert`` and ``tls_key``), the files
    checked to parse first (gRPC reports a bad one only in its own log, then fails to
    bind); ``tls_client_ca``: the CAs whose client certificates are required."""
    if tls_cert is None or tls_key is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(tls_cert, tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ServerConfigError(
            f"tls_cert {tls_cert} and tls_key {tls_key} are not a PEM "
            f"certificate chain and its private key ({_reason(exc)})"
        ) from exc
    client_ca = None
    if tls_client_ca is not None:
        try:
            context.load_verify_locations(cafile=tls_client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ServerConfigError(
                f"tls_client_ca {tls_client_ca} is not a PEM CA bundle ({_reason(exc)})"
            ) from exc
        client_ca = tls_client_ca.read_bytes()
    return grpc.ssl_server_credentials(
        [(tls_key.read_bytes(), tls_cert.read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)
