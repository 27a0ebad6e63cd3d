"""How EmbeddingClient reaches the real server: bearer tokens, TLS and mutual TLS
(certificates made with the ``cryptography`` package), and load balancing over replicas."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from client_support import (
    SENTENCE,
    client_for,
    rejections,
    requests_of,
)

from tokembed.client import (
    AuthenticationError,
    EmbeddingClient,
    EmbeddingError,
    UnavailableError,
)

from support.server import ServerThread

SC = grpc.StatusCode
Start = Callable[..., ServerThread]


# ---------------------------------------------------------------- auth, TLS


def test_bearer_token_is_sent(
    start_server: Start, small_model_dir: Path, small_rows: np.ndarray, tmp_path: Path
) -> None:
    (tmp_path / "token").write_text("s3cret\n")
    server = start_server(small_model_dir, auth_token_file=tmp_path / "token")
    with client_for(server, token="s3cret\n") as client:  # surrounding whitespace goes
        np.testing.assert_array_equal(client.embed([[1]]), small_rows[[[1]]])
    for token in ("wrong", None):
        with client_for(server, token=token, retries=3, chunked_threshold_bytes=None) as client:
            with pytest.raises(AuthenticationError) as info:
                client.embed([[1]])
            assert client.health() == "SERVING"  # health checks need no token
        assert (info.value.code, info.value.reason) == (SC.UNAUTHENTICATED, "unauthenticated")
        assert info.value.attempts == 1
    assert rejections(server, "unauthenticated") == 2


def test_bad_tokens_are_refused() -> None:
    for token in ("", "two words", "tab\there"):
        with pytest.raises(EmbeddingError, match="token"):
            EmbeddingClient("127.0.0.1:1", token=token)


def test_tls(
    start_server: Start, small_model_dir: Path, small_rows: np.ndarray, pki: SimpleNamespace
) -> None:
    server = start_server(small_model_dir, tls_cert=pki.server.cert, tls_key=pki.server.key)
    with client_for(server, root_certificates=pki.ca) as client:
        np.testing.assert_array_equal(client.embed(SENTENCE), small_rows[SENTENCE])
    # The name checked against the certificate, apart from the address.
    with client_for(server, root_certificates=pki.ca, tls_server_name="localhost") as client:
        np.testing.assert_array_equal(client.embed([[3]]), small_rows[[[3]]])
    # A plaintext client gets no answer from a TLS port.
    with client_for(server, retries=0) as client, pytest.raises(UnavailableError):
        client.embed([[1]], timeout_s=10)
    # PEM bytes work as well as paths.
    with client_for(server, root_certificates=pki.ca.read_bytes()) as client:
        assert client.health() == "SERVING"


def test_mutual_tls_with_a_token(
    start_server: Start,
    small_model_dir: Path,
    small_rows: np.ndarray,
    pki: SimpleNamespace,
    tmp_path: Path,
) -> None:
    (tmp_path / "token").write_text("t0ken")
    server = start_server(
        small_model_dir,
        tls_cert=pki.server.cert,
        tls_key=pki.server.key,
        tls_client_ca=pki.ca,
        auth_token_file=tmp_path / "token",
    )
    with client_for(
        server,
        root_certificates=pki.ca,
        client_certificate=pki.client.cert,
        client_key=pki.client.key,
        token="t0ken",
    ) as client:
        np.testing.assert_array_equal(client.embed([[3]]), small_rows[[[3]]])
    # Without a client certificate the handshake fails: no call reaches the server.
    with (
        client_for(server, root_certificates=pki.ca, token="t0ken", retries=0) as client,
        pytest.raises(UnavailableError),
    ):
        client.embed([[1]], timeout_s=10)
    assert requests_of(server, "Embed") == 1


def test_tls_options_are_checked(pki: SimpleNamespace, tmp_path: Path) -> None:
    with pytest.raises(EmbeddingError, match="both client_certificate and client_key"):
        EmbeddingClient("127.0.0.1:1", client_certificate=pki.client.cert)
    with pytest.raises(EmbeddingError, match="cannot read root certificates"):
        EmbeddingClient("127.0.0.1:1", root_certificates=tmp_path / "missing.pem")


# ---------------------------------------------------------------- load balancing


def _spread(servers: list[ServerThread]) -> list[int]:
    return [requests_of(s, "Embed") for s in servers]


def _replicas(start_server: Start, model_dir: Path, count: int) -> list[ServerThread]:
    return [start_server(model_dir) for _ in range(count)]


def test_round_robin_spreads_over_all_addresses(
    start_server: Start, small_model_dir: Path, small_rows: np.ndarray
) -> None:
    servers = _replicas(start_server, small_model_dir, 3)
    target = "ipv4:" + ",".join(s.target for s in servers)
    with client_for(target, load_balancing_policy="round_robin") as client:
        # round_robin picks among the connections already made: warm up until all are
        # (the bound only keeps a broken client from looping for ever).
        give_up_at = time.monotonic() + 60
        while min(_spread(servers)) == 0:
            assert time.monotonic() < give_up_at, _spread(servers)
            client.embed([[1]])
        warm = _spread(servers)
        for i in range(60):
            np.testing.assert_array_equal(client.embed([[i]]), small_rows[[[i]]])
    counts = [after - before for after, before in zip(_spread(servers), warm, strict=True)]
    assert sum(counts) == 60
    assert min(counts) >= 10, counts  # pick_first would give [0, 0, 60]


def test_without_round_robin_one_address_gets_everything(
    start_server: Start, small_model_dir: Path
) -> None:
    servers = _replicas(start_server, small_model_dir, 2)
    target = "ipv4:" + ",".join(s.target for s in servers)
    with client_for(target) as client:
        for _ in range(10):
            client.embed([[1]])
    assert sorted(_spread(servers)) == [0, 10]  # pick_first: why round_robin is needed


def test_round_robin_fails_over_when_a_replica_goes(
    start_server: Start, small_model_dir: Path, small_rows: np.ndarray
) -> None:
    servers = _replicas(start_server, small_model_dir, 3)
    target = "ipv4:" + ",".join(s.target for s in servers)
    with client_for(target, load_balancing_policy="round_robin", backoff_s=0.02) as client:
        for _ in range(9):
            client.embed([[1]])
        servers[0].stop()
        for i in range(30):
            np.testing.assert_array_equal(client.embed([[i]]), small_rows[[[i]]])
    assert (
        requests_of(servers[1], "Embed", code="OK") + requests_of(servers[2], "Embed", code="OK")
        >= 30
    )


def test_dns_target_with_round_robin(real_server: ServerThread, small_rows: np.ndarray) -> None:
    target = f"dns:///127.0.0.1:{real_server.port}"
    with client_for(target, load_balancing_policy="round_robin") as client:
        np.testing.assert_array_equal(client.embed(SENTENCE), small_rows[SENTENCE])


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(EmbeddingError, match="load_balancing_policy"):
        EmbeddingClient("127.0.0.1:1", load_balancing_policy="random")
