"""The gRPC server: its options, interceptors and services (tokembed.v1, the Open
Inference Protocol, health, reflection), and the address it listens on. server/app.py runs it,
with the options it takes from the settings (``GrpcOptions``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from tokembed import __version__
from tokembed.server.core.calls import ModelTotals
from tokembed.server.core.control import ModelControl
from tokembed.server.core.dataplane import DataPlane
from tokembed.server.core.errors import ServerConfigError
from tokembed.server.edge.auth import BearerTokenInterceptor, Identities, read_token
from tokembed.server.edge.control_access import ControlAccessInterceptor, is_loopback
from tokembed.server.edge.health import HEALTH_SERVICE, HealthFrontEnd
from tokembed.server.edge.listening import check_port_free, tls_credentials
from tokembed.server.edge.v1.requests import EmbedParser
from tokembed.server.edge.v1.servicer import SERVICE_NAME, EmbeddingServicer, generic_handler
from tokembed.server.edge.v2 import servicer as v2
from tokembed.server.edge.v2.repository_service import CONTROL_METHODS
from tokembed.server.edge.v2.requests import InferParser
from tokembed.server.edge.v2.shm import SharedMemoryRegistry
from tokembed.server.edge.v2.shm_service import SharedMemoryInputs
from tokembed.v1 import embedding_pb2


@dataclass(frozen=True)
class GrpcOptions:
    """What the gRPC server and its front ends take from the settings, under the
    settings' names (server/process/settings.py says what each means)."""

    host: str
    port: int
    workers: int
    tls_cert: Path | None
    tls_key: Path | None
    tls_client_ca: Path | None
    auth_token_file: Path | None
    control_token_file: Path | None
    max_message_bytes: int
    max_receive_bytes: int
    max_request_bytes: int
    max_tokens_per_request: int
    max_concurrent_streams: int
    max_connection_age_s: float
    grace_s: float
    stream_chunk_bytes: int


def build_grpc_server(
    options: GrpcOptions,
    dataplane: DataPlane,
    shared_memory: SharedMemoryRegistry,
    statistics: Callable[[str], ModelTotals | None],
    health_servicer: health.aio.HealthServicer,
    *,
    on_unauthenticated: Callable[[str], None],
    control: ModelControl | None = None,
) -> grpc.aio.Server:
    """Both front ends over ``dataplane``, health and reflection, on a server not yet
    bound (``bind``); ``on_unauthenticated(method)`` hears of each call the bearer-token
    check refuses; ``control``: what V2's repository methods drive (they take the control
    credential, ``control_access``)."""
    # Without the token, health tells the status of the server and of its protocol's
    # service: the names orchestrators probe. A model's name is the caller's to know.
    health_front_end = HealthFrontEnd(health_servicer, public=("", SERVICE_NAME))
    interceptors: list[grpc.aio.ServerInterceptor] = []
    control_methods = [f"/{v2.SERVICE_NAME}/{name}" for name in CONTROL_METHODS]
    control_token = (
        None if options.control_token_file is None
        else read_token(options.control_token_file, "control_token_file")
    )  # fmt: skip
    interceptors.append(
        ControlAccessInterceptor(
            control_methods, token=control_token, loopback_only=is_loopback(options.host),
            on_reject=on_unauthenticated,
        )
    )  # fmt: skip
    if options.auth_token_file is not None:
        token = read_token(options.auth_token_file)
        if token == control_token:
            raise ServerConfigError(
                "control_token_file and auth_token_file hold the same token: control needs "
                "a credential of its own"
            )
        interceptors.append(
            BearerTokenInterceptor(
                token, on_reject=on_unauthenticated,
                open_methods=health_front_end.unauthenticated(),
                # With a control token, the control methods present it instead.
                skipped=control_methods if control_token is not None else (),
            )
        )  # fmt: skip
    aging: list[tuple[str, int]] = []
    if options.max_connection_age_s > 0:
        # GOAWAY after this age; calls in flight get the grace period to finish.
        aging.append(("grpc.max_connection_age_ms", int(options.max_connection_age_s * 1000)))
        aging.append(("grpc.max_connection_age_grace_ms", int(options.grace_s * 1000)))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            *aging,
            ("grpc.max_send_message_length", options.max_message_bytes),
            # The largest valid request with a margin (Settings.max_receive_bytes): what
            # any caller, before its token is checked, can make the server buffer per call.
            ("grpc.max_receive_message_length", options.max_receive_bytes),
            # ... and how many calls one connection may have open at once.
            ("grpc.max_concurrent_streams", options.max_concurrent_streams),
            # Several processes may share one port only when asked (--workers).
            ("grpc.so_reuseport", 1 if options.workers > 1 else 0),
            # Clients keep long streams alive with a ping a minute; gRPC's default
            # server policy (one per 5 minutes) would close them for "too many pings".
            ("grpc.http2.min_ping_interval_without_data_ms", 30_000),
        ],
    )
    servicer = EmbeddingServicer(
        dataplane, chunk_bytes=options.stream_chunk_bytes,
        max_message_bytes=options.max_message_bytes,
        parse=EmbedParser(options.max_request_bytes, options.max_tokens_per_request),
    )  # fmt: skip
    # The Open Inference Protocol on the same port: another front end over the same
    # data plane.
    inference = v2.InferenceServicer(
        dataplane,
        parse=InferParser(
            options.max_request_bytes, options.max_tokens_per_request,
            source=SharedMemoryInputs(shared_memory, options.max_request_bytes),
        ),
        max_message_bytes=options.max_message_bytes, version=__version__,
        statistics=statistics, shared_memory=shared_memory,
        identities=Identities(
            client_certificates=options.tls_client_ca is not None,
            token=options.auth_token_file is not None,
        ),
        extensions=(*v2.EXTENSIONS, "system_shared_memory")
        if shared_memory.enabled else v2.EXTENSIONS,
        control=control,
    )  # fmt: skip
    server.add_generic_rpc_handlers(
        [generic_handler(servicer), v2.generic_handler(inference), health_front_end.handler()]
    )
    reflection.enable_server_reflection(
        [SERVICE_NAME, HEALTH_SERVICE, reflection.SERVICE_NAME], server
    )
    _ = embedding_pb2  # the descriptor pool must hold our service for reflection
    return server


def bind(server: grpc.aio.Server, options: GrpcOptions) -> int:
    """Listen on ``options``' address (TLS when configured); return the bound port."""
    address = f"{options.host}:{options.port}"
    # Checked first, so that the mistake is one line of ours and not gRPC's C-core log
    # lines and a RuntimeError.
    credentials = tls_credentials(options.tls_cert, options.tls_key, options.tls_client_ca)
    if options.workers == 1:  # workers share the port on purpose (SO_REUSEPORT)
        check_port_free(options.host, options.port)
    try:
        if credentials is not None:
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio raises where it used to return 0
        raise ServerConfigError(f"cannot listen on {address}: {exc}") from exc
    if port == 0:
        raise ServerConfigError(f"cannot listen on {address}")
    return int(port)
