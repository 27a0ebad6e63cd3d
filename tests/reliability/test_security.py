"""Security, for real: TLS and mutual TLS on ``tokembed serve`` with certificates made
here (the ``cryptography`` package), a bearer token read from a file, and the bind
addresses of the gRPC and metrics ports.

tests/server/test_auth.py covers the token on every method (missing, wrong, other
schemes, health exempt); this file adds what needs the real command: the token file
through the flag, refusing to start without a usable token, the constant-time
comparison, reflection behind the token, and the token over mutual TLS.
"""

from __future__ import annotations

import contextlib
import hmac
import signal
import subprocess
import sys
import urllib.error
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from reliability_support import EMBED

from tokembed.client import AuthenticationError, EmbeddingClient, UnavailableError

from support.metrics import scrape, value
from support.requests import encode
from support.server import ServerProcess, ServerThread, serve_args

TOKEN = "tok-3f9a0c1e-embeddings"
IDS = np.array([[3, 1, 4, 1, 5]])


def _started(args: list[str]) -> Iterator[ServerProcess]:
    server = ServerProcess(args).start()
    try:
        yield server
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        finally:
            server.kill()


@pytest.fixture(scope="module")
def tls_server(small_model_dir: Path, pki: SimpleNamespace) -> Iterator[ServerProcess]:
    yield from _started(
        serve_args(
            small_model_dir, "--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key)
        )
    )


@pytest.fixture(scope="module")
def mtls_server(
    small_model_dir: Path, pki: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(f"  {TOKEN}\n")
    token_file.chmod(0o600)
    yield from _started(
        serve_args(
            small_model_dir,
            "--tls-cert",
            str(pki.server.cert),
            "--tls-key",
            str(pki.server.key),
            "--tls-client-ca",
            str(pki.ca),
            "--auth-token-file",
            str(token_file),
        )
    )


def _embed(target: str, **options: Any) -> np.ndarray:
    with EmbeddingClient(target, retries=0, timeout_s=10, **options) as client:
        return np.asarray(client.embed(IDS))


def _plaintext_call(target: str) -> grpc.StatusCode:
    with grpc.insecure_channel(target) as channel:
        try:
            channel.unary_unary(EMBED)(encode(IDS), timeout=10)
        except grpc.RpcError as error:
            return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


# --- TLS


def test_tls_serves_a_client_that_trusts_its_ca(
    tls_server: ServerProcess, pki: SimpleNamespace, small_rows: np.ndarray
) -> None:
    assert "(gRPC, TLS)" in tls_server.output
    np.testing.assert_array_equal(
        _embed(tls_server.target, root_certificates=pki.ca), small_rows[IDS]
    )
    # The name checked against the certificate can be set apart from the address.
    got = _embed(tls_server.target, root_certificates=pki.ca, tls_server_name="localhost")
    np.testing.assert_array_equal(got, small_rows[IDS])
    # Health checks go over TLS too.
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
    with grpc.secure_channel(tls_server.target, credentials) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="plaintext client"),
        pytest.param({"tls": True}, id="system roots only"),
        pytest.param({"root_certificates": "other_ca"}, id="another CA"),
        pytest.param(
            {"root_certificates": "ca", "tls_server_name": "wrong.example"}, id="wrong name"
        ),
    ],
)
def test_tls_refuses_clients_that_cannot_verify_or_do_not_speak_it(
    tls_server: ServerProcess, pki: SimpleNamespace, options: dict[str, Any]
) -> None:
    options = {k: getattr(pki, v) if k == "root_certificates" else v for k, v in options.items()}
    with pytest.raises(UnavailableError):
        _embed(tls_server.target, **options)


def test_a_plaintext_call_on_the_tls_port_is_refused(tls_server: ServerProcess) -> None:
    assert _plaintext_call(tls_server.target) == grpc.StatusCode.UNAVAILABLE


# --- mutual TLS (with the bearer token on top)


def test_mutual_tls_serves_a_client_with_a_certificate_from_its_ca(
    mtls_server: ServerProcess, pki: SimpleNamespace, small_rows: np.ndarray
) -> None:
    got = _embed(
        mtls_server.target, root_certificates=pki.ca, client_certificate=pki.client.cert,
        client_key=pki.client.key, token=TOKEN,
    )  # fmt: skip
    np.testing.assert_array_equal(got, small_rows[IDS])


@pytest.mark.parametrize(
    "client",
    [None, "foreign_client", "self_signed_client"],
    ids=["no certificate", "another CA's", "self-signed"],
)
def test_mutual_tls_refuses_a_client_without_a_valid_certificate(
    mtls_server: ServerProcess, pki: SimpleNamespace, client: str | None
) -> None:
    options: dict[str, Any] = {"root_certificates": pki.ca, "token": TOKEN}
    if client is not None:
        issued = getattr(pki, client)
        options |= {"client_certificate": issued.cert, "client_key": issued.key}
    with pytest.raises(UnavailableError):
        _embed(mtls_server.target, **options)
    # ... at the TLS layer, before any RPC: even health checks need the certificate.
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.read_bytes(),
        private_key=options["client_key"].read_bytes() if client else None,
        certificate_chain=options["client_certificate"].read_bytes() if client else None,
    )
    with (
        grpc.secure_channel(mtls_server.target, credentials) as channel,
        pytest.raises(grpc.RpcError) as error,
    ):
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_plaintext(mtls_server: ServerProcess) -> None:
    assert _plaintext_call(mtls_server.target) == grpc.StatusCode.UNAVAILABLE


def test_the_token_is_still_required_over_mutual_tls(
    mtls_server: ServerProcess, pki: SimpleNamespace
) -> None:
    certificate = {
        "root_certificates": pki.ca,
        "client_certificate": pki.client.cert,
        "client_key": pki.client.key,
    }
    with pytest.raises(AuthenticationError):
        _embed(mtls_server.target, **certificate)
    with pytest.raises(AuthenticationError):
        _embed(mtls_server.target, token="not-" + TOKEN, **certificate)


# --- the bearer token


def test_reflection_sits_behind_the_token_but_health_does_not(
    small_model_dir: Path, start_server: Callable[..., ServerThread], tmp_path: Path
) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    server = start_server(small_model_dir, auth_token_file=token_file)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            list(stub.ServerReflectionInfo(iter([request]), timeout=10))
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        answers = list(stub.ServerReflectionInfo(iter([request]), metadata=metadata, timeout=10))
        services = {s.name for s in answers[0].list_services_response.service}
        assert "tokembed.v1.EmbeddingService" in services
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_the_token_is_compared_in_constant_time(
    small_model_dir: Path, start_server: Callable[..., ServerThread], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Every presented token goes through hmac.compare_digest (time independent of where
    the first difference is), never through ==."""
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        compared.append((bytes(a), bytes(b)))
        return real(a, b)

    monkeypatch.setattr("tokembed.server.edge.auth.hmac.compare_digest", spy)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    server = start_server(small_model_dir, auth_token_file=token_file)
    tokens = (TOKEN, "x" + TOKEN[1:], TOKEN[:-1] + "x", "short")
    for token in tokens:
        client = EmbeddingClient(server.target, retries=0, timeout_s=10, token=token)
        with client, contextlib.suppress(AuthenticationError):
            client.embed(IDS)
    # Each call's token was compared with hmac.compare_digest (a call may be more than
    # one RPC: the client asks for the model's limits once).
    assert {a for a, _ in compared} == {f"Bearer {t}".encode() for t in tokens}
    assert all(b == f"Bearer {TOKEN}".encode() for _, b in compared)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [(None, "cannot read auth_token_file"), ("", "is empty"), ("  \n", "is empty")],
    ids=["missing file", "empty file", "blank file"],
)
def test_serve_refuses_to_start_without_a_usable_token(
    small_model_dir: Path, tmp_path: Path, content: str | None, fragment: str
) -> None:
    token_file = tmp_path / "token"
    if content is not None:
        token_file.write_text(content)
    result = subprocess.run(
        [sys.executable, "-m", "tokembed.cli", "serve",
         *serve_args(small_model_dir, "--auth-token-file", str(token_file))],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tokembed serve: error: ") and fragment in last


# --- bind addresses


def _can_connect(host: str, port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(5)
        return sock.connect_ex((host, port)) == 0


def test_both_ports_bind_to_loopback_by_default(small_model_dir: Path) -> None:
    server = ServerProcess(serve_args(small_model_dir)).start()
    try:
        assert "listening on 127.0.0.1:" in server.output
        assert "metrics on http://127.0.0.1:" in server.output
        assert value(scrape(server.metrics_port), "tokembed_ready") == 1
        # Bound to 127.0.0.1 alone, not to every address: another loopback address of
        # this machine finds nothing listening on either port.
        assert not _can_connect("127.0.0.2", server.metrics_port)
        assert not _can_connect("127.0.0.2", server.port)
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0


def test_metrics_and_grpc_bind_where_told(small_model_dir: Path, small_rows: np.ndarray) -> None:
    args = serve_args(small_model_dir, "--metrics-host", "127.0.0.2", "--host", "127.0.0.3")
    server = ServerProcess(args).start()
    try:
        assert "metrics on http://127.0.0.2:" in server.output
        assert value(scrape(server.metrics_port, host="127.0.0.2"), "tokembed_ready") == 1
        with pytest.raises(urllib.error.URLError):
            scrape(server.metrics_port, host="127.0.0.1")
        with EmbeddingClient(f"127.0.0.3:{server.port}", retries=0, timeout_s=10) as client:
            np.testing.assert_array_equal(client.embed(IDS), small_rows[IDS])
        assert not _can_connect("127.0.0.1", server.port)
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
