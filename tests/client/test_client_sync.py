"""EmbeddingClient against a real gRPC server on loopback.

The server is the scripted fake of client_fakes.py, standing in for the real server only
because that one is being written at the same time (tests/e2e/ will run the real one).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from client_fakes import (
    FAKE_NAME,
    FAKE_VERSION,
    Abort,
    D,
    Delay,
    FakeServer,
    FakeService,
    free_port,
    make_certificates,
    rows,
)
from grpc_health.v1 import health_pb2

from tokembed.client import (
    AuthenticationError,
    DeadlineExceededError,
    EmbeddingClient,
    EmbeddingError,
    EmbedResult,
    InvalidInputError,
    ModelNotFoundError,
    OverloadedError,
    RequestTooLargeError,
    ServerError,
    UnavailableError,
)
from tokembed.v1 import embedding_pb2 as pb

SC = grpc.StatusCode
SENTENCE = [[5, 6, 7, 8, 9, 10, 11, 12]]  # "The keys on the table are lost."


def client_for(server: FakeServer | str, **kwargs: Any) -> EmbeddingClient:
    target = server if isinstance(server, str) else server.address
    kwargs.setdefault("timeout_s", 10.0)
    return EmbeddingClient(target, **kwargs)


# ---------------------------------------------------------------- the happy paths


def test_embed_the_sentence(fake: FakeServer) -> None:
    with client_for(fake) as client:
        hs = client.embed(SENTENCE)
    assert hs.shape == (1, 8, D)
    assert hs.dtype == np.float32
    assert np.array_equal(hs, rows(SENTENCE))
    assert not hs.flags.writeable  # zero-copy view of the reply


def test_first_embed_asks_for_model_info_once(fake: FakeServer) -> None:
    with client_for(fake) as client:
        client.embed([[1, 2]])
        client.embed([[3]])
    assert [c.method for c in fake.service.calls] == ["GetModelInfo", "Embed", "Embed"]


def test_no_model_info_when_chunking_is_off(fake: FakeServer) -> None:
    with client_for(fake, chunked_threshold_bytes=None) as client:
        client.embed([[1, 2]])
    assert [c.method for c in fake.service.calls] == ["Embed"]


def test_int32_ids_travel_as_int32(fake: FakeServer) -> None:
    with client_for(fake) as client:
        hs = client.embed(np.array([[1, 2, 3]], dtype=np.int32))
    sent = fake.service.calls[-1].request
    assert sent.input_ids.dtype == pb.DTYPE_INT32
    assert np.array_equal(hs, rows([[1, 2, 3]]))


def test_ragged_padded_and_flat(fake: FakeServer) -> None:
    seqs = [[1, 2, 3], [4], [5, 6]]
    with client_for(fake) as client:
        padded = client.embed_result(seqs)
        flat = client.embed_result(seqs, layout="flat")
        rect_flat = client.embed([[1, 2], [3, 4]], layout="flat")
    assert padded.hidden_states.shape == (3, 3, D)
    assert padded.lengths is not None and padded.lengths.tolist() == [3, 1, 2]
    for seq, part in zip(seqs, padded.sequences(), strict=True):
        assert np.array_equal(part, rows(seq))
    assert flat.hidden_states.shape == (6, D)
    assert np.array_equal(flat.hidden_states, rows([1, 2, 3, 4, 5, 6]))
    assert rect_flat.shape == (4, D)  # flat is [N,D] for rectangular input too


def test_float16(fake: FakeServer) -> None:
    with client_for(fake) as client:
        hs = client.embed([[1, 2, 3]], "float16")
    assert hs.dtype == np.float16
    assert fake.service.calls[-1].request.output_dtype == pb.DTYPE_FLOAT16
    assert np.array_equal(hs, rows([[1, 2, 3]], dtype=np.float16))


def test_embed_result_carries_server_metadata(fake: FakeServer) -> None:
    with client_for(fake) as client:
        result = client.embed_result([[1, 2]], request_id="req-42")
    assert isinstance(result, EmbedResult)
    assert (result.model_name, result.model_version, result.request_id) == (
        FAKE_NAME,
        FAKE_VERSION,
        "req-42",
    )
    assert result.timings.compute_seconds == pytest.approx(0.002)
    assert result.timings.batch_tokens == 2


def test_model_info(fake: FakeServer) -> None:
    with client_for(fake) as client:
        info = client.model_info()
    assert (info.name, info.d_model, info.padding_id) == (FAKE_NAME, D, 0)
    assert info.input_dtypes == ("int64", "int32")
    assert info.limits.max_message_bytes == 64 * 1024 * 1024
    with pytest.raises(AttributeError):
        info.name = "x"  # type: ignore[misc]  # frozen


def test_torch_like_input(fake: FakeServer) -> None:
    class Tensorish:
        def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
            return np.array([[7, 8, 9]])

    with client_for(fake) as client:
        assert np.array_equal(client.embed(Tensorish()), rows([[7, 8, 9]]))


def test_invalid_input_is_refused_without_a_call(fake: FakeServer) -> None:
    with (
        client_for(fake, chunked_threshold_bytes=None) as client,
        pytest.raises(InvalidInputError, match="float"),
    ):
        client.embed([[1.5, 2.0]])
    assert fake.service.calls == []


# ---------------------------------------------------------------- errors from the server


@pytest.mark.parametrize(
    ("abort", "cls"),
    [
        (Abort(SC.INVALID_ARGUMENT, "invalid_input", "id 40000 at [0,1] >= V"), InvalidInputError),
        (Abort(SC.RESOURCE_EXHAUSTED, "too_large", "too many tokens"), RequestTooLargeError),
        (Abort(SC.RESOURCE_EXHAUSTED, "overloaded", "queue full"), OverloadedError),
        (Abort(SC.INTERNAL, "internal", "boom"), ServerError),
        (Abort(SC.UNAUTHENTICATED, "unauthenticated", "bad token"), AuthenticationError),
    ],
)
def test_server_errors_are_typed_and_not_retried(
    fake: FakeServer, abort: Abort, cls: type[EmbeddingError]
) -> None:
    fake.service.script.append(abort)
    with (
        client_for(fake, retries=3, backoff_s=0.01, chunked_threshold_bytes=None) as client,
        pytest.raises(cls) as info,
    ):
        client.embed([[1]])
    assert info.value.code == abort.code
    assert info.value.reason == abort.reason
    assert abort.message in str(info.value)
    assert isinstance(info.value.__cause__, grpc.RpcError)
    assert fake.service.count("Embed") == 1


def test_model_name_mismatch(fake: FakeServer) -> None:
    with (
        client_for(fake, model_name="other-model", chunked_threshold_bytes=None) as client,
        pytest.raises(ModelNotFoundError, match="other-model"),
    ):
        client.embed([[1]])
    with client_for(fake, model_name=FAKE_NAME, chunked_threshold_bytes=None) as client:
        assert client.embed([[1]]).shape == (1, 1, D)


@pytest.mark.parametrize("method", ["embed", "embed_result"])
def test_wrong_shape_from_server_is_a_protocol_error(fake: FakeServer, method: str) -> None:
    def drop_a_row(response: pb.EmbedResponse) -> pb.EmbedResponse:
        t = response.hidden_states
        b, s, d = t.shape
        t.shape[:] = [b, s - 1, d]
        t.data = t.data[: b * (s - 1) * d * 4]
        return response

    fake.service.mutate = drop_a_row
    with (
        client_for(fake, chunked_threshold_bytes=None) as client,
        pytest.raises(ServerError, match="shape") as info,
    ):
        getattr(client, method)([[1, 2, 3]])
    assert info.value.reason == "protocol"


# ---------------------------------------------------------------- retries and deadlines


def test_unavailable_twice_then_success(fake: FakeServer) -> None:
    fake.service.script += [Abort(SC.UNAVAILABLE, "unavailable")] * 2
    with client_for(fake, retries=2, backoff_s=0.01, chunked_threshold_bytes=None) as client:
        hs = client.embed(SENTENCE)
    assert np.array_equal(hs, rows(SENTENCE))
    assert fake.service.count("Embed") == 3


def test_retries_are_bounded(fake: FakeServer) -> None:
    fake.service.script += [Abort(SC.UNAVAILABLE, "unavailable", "draining")] * 5
    with (
        client_for(fake, retries=2, backoff_s=0.01, chunked_threshold_bytes=None) as client,
        pytest.raises(UnavailableError, match="gave up after 3 attempts") as info,
    ):
        client.embed([[1]])
    assert info.value.attempts == 3
    assert fake.service.count("Embed") == 3


def test_backoff_grows_exponentially_with_jitter(fake: FakeServer) -> None:
    fake.service.script += [Abort(SC.UNAVAILABLE, "unavailable")] * 3
    with client_for(
        fake, retries=3, backoff_s=0.1, backoff_max_s=10, chunked_threshold_bytes=None
    ) as client:
        client.embed([[1]])
    arrivals = [c.at for c in fake.service.calls if c.method == "Embed"]
    gaps = np.diff(arrivals)
    assert len(gaps) == 3
    # The n-th wait is drawn from [d/2, d], d = 0.1 * 2^n (plus scheduling noise above).
    for n, gap in enumerate(gaps):
        ceiling = 0.1 * 2**n
        assert gap >= ceiling / 2 - 0.01, (n, gaps)
        assert gap < ceiling + 1.0, (n, gaps)


def test_backoff_is_capped(fake: FakeServer, caplog: pytest.LogCaptureFixture) -> None:
    fake.service.script += [Abort(SC.UNAVAILABLE, "unavailable")] * 4
    with (
        caplog.at_level(logging.INFO, logger="tokembed.client"),
        client_for(
            fake, retries=4, backoff_s=0.05, backoff_max_s=0.06, chunked_threshold_bytes=None
        ) as client,
    ):
        client.embed([[1]])
    gaps = np.diff([c.at for c in fake.service.calls if c.method == "Embed"])
    assert len(gaps) == 4
    # The waits the client chose, from its log line per retry (the gaps between arrivals
    # add each call's own time, which a loaded machine stretches). Uncapped, the 4th would
    # be drawn from [0.2, 0.4]; capped, each is drawn from [0.03, 0.06] once 0.05·2^n > 0.06.
    delays = [float(r.getMessage().rsplit(" in ", 1)[1].split()[0]) for r in caplog.records
              if "; retry " in r.getMessage()]  # fmt: skip
    assert len(delays) == 4, caplog.text
    assert 0.025 <= delays[0] <= 0.05 and all(0.03 <= d <= 0.06 for d in delays[1:]), delays
    # ... and they were slept (the log rounds to 1 ms).
    assert all(gap >= delay - 0.001 for gap, delay in zip(gaps, delays, strict=True))


def test_overall_timeout_spans_the_retries(fake: FakeServer) -> None:
    fake.service.script += [Abort(SC.UNAVAILABLE, "unavailable")] * 1000
    with client_for(
        fake, timeout_s=0.6, retries=1000, backoff_s=0.05, backoff_max_s=0.1,
        chunked_threshold_bytes=None,
    ) as client:  # fmt: skip
        start = time.monotonic()
        # The last attempt's error: refused (no time left for another), or out of time
        # during it, which of the two depends on how long each attempt took.
        with pytest.raises((UnavailableError, DeadlineExceededError)) as info:
            client.embed([[1]])
        elapsed = time.monotonic() - start
    assert elapsed < 0.6 + 0.5
    assert 2 <= info.value.attempts < 1000
    assert f"gave up after {info.value.attempts} attempts" in str(info.value)
    # Each attempt got the deadline that was left, not a fresh timeout_s.
    remaining = [c.time_remaining for c in fake.service.calls if c.method == "Embed"]
    # (gRPC sends the timeout rounded up to its wire units: allow 10 ms over 0.6 s.)
    assert all(r is not None and r <= 0.61 for r in remaining)
    last = remaining[-1]
    assert last is not None and last < 0.35  # the last attempts ran late in the 0.6 s


def test_slow_server_hits_the_deadline(fake: FakeServer) -> None:
    fake.service.script.append(Delay(3.0))
    with client_for(fake, chunked_threshold_bytes=None) as client:
        start = time.monotonic()
        with pytest.raises(DeadlineExceededError) as info:
            client.embed([[1]], timeout_s=0.3)
        assert time.monotonic() - start < 2.0
    assert info.value.code == SC.DEADLINE_EXCEEDED
    assert fake.service.count("Embed") == 1  # a deadline is not retried


def test_overload_retried_only_when_asked(fake: FakeServer) -> None:
    overloaded = Abort(SC.RESOURCE_EXHAUSTED, "overloaded", "queue full")
    fake.service.script += [overloaded] * 2
    with (
        client_for(fake, retries=3, backoff_s=0.01, chunked_threshold_bytes=None) as client,
        pytest.raises(OverloadedError),
    ):
        client.embed([[1]])
    assert fake.service.count("Embed") == 1
    with client_for(
        fake, retries=3, backoff_s=0.01, retry_on_overload=True, chunked_threshold_bytes=None
    ) as client:
        assert client.embed([[1]]).shape == (1, 1, D)
    assert fake.service.count("Embed") == 1 + 2  # one more failure, then the answer


def test_too_large_never_retried_even_with_retry_on_overload(fake: FakeServer) -> None:
    fake.service.script += [Abort(SC.RESOURCE_EXHAUSTED, "too_large")] * 3
    with (
        client_for(
            fake, retries=3, backoff_s=0.01, retry_on_overload=True, chunked_threshold_bytes=None
        ) as client,
        pytest.raises(RequestTooLargeError),
    ):
        client.embed([[1]])
    assert fake.service.count("Embed") == 1


def test_stopped_server_raises_unavailable_after_retries() -> None:
    target = f"127.0.0.1:{free_port()}"
    with client_for(target, retries=2, backoff_s=0.01) as client:
        start = time.monotonic()
        with pytest.raises(UnavailableError) as info:
            client.embed([[1]])
        assert time.monotonic() - start < 5
    assert info.value.attempts == 3
    assert info.value.code == SC.UNAVAILABLE


def test_retry_is_logged(fake: FakeServer, caplog: pytest.LogCaptureFixture) -> None:
    fake.service.script.append(Abort(SC.UNAVAILABLE, "unavailable"))
    with (
        caplog.at_level(logging.INFO, logger="tokembed.client"),
        client_for(fake, backoff_s=0.01, chunked_threshold_bytes=None) as client,
    ):
        client.embed([[1]])
    assert any("retry 1" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- message size, chunks


def test_large_reply_fits_the_default_receive_limit(
    fake_factory: Callable[..., FakeServer],
) -> None:
    server = fake_factory(FakeService(d_model=1024))
    ids = np.arange(1500).reshape(1, 1500)  # 1500 * 1024 * 4 = 6 MB > gRPC's 4 MiB default
    with client_for(server, chunked_threshold_bytes=None) as client:
        hs = client.embed(ids)
    assert hs.shape == (1, 1500, 1024)
    assert np.array_equal(hs[0, -1], rows([1499], 1024)[0])


def test_receive_limit_is_the_clients_setting(fake_factory: Callable[..., FakeServer]) -> None:
    server = fake_factory(FakeService(d_model=1024))
    ids = np.arange(600).reshape(1, 600)  # 2.4 MB
    with (
        client_for(
            server, max_message_bytes=1024 * 1024, chunked_threshold_bytes=None, retries=3
        ) as client,
        pytest.raises(RequestTooLargeError),
    ):
        client.embed(ids)
    assert server.service.count("Embed") == 1


def test_large_outputs_go_chunked_transparently(fake: FakeServer) -> None:
    ids = np.arange(200).reshape(4, 50)  # 200 * 8 * 4 = 6400 bytes > 1000
    with client_for(fake, chunked_threshold_bytes=1000) as client:
        chunked = client.embed_result(ids, request_id="big")
        small = client.embed([[1, 2]])  # 64 bytes: unary
    assert [c.method for c in fake.service.calls] == ["GetModelInfo", "EmbedChunked", "Embed"]
    assert np.array_equal(chunked.hidden_states, rows(ids))
    assert chunked.hidden_states.shape == (4, 50, D)
    assert chunked.request_id == "big"
    assert chunked.hidden_states.flags.writeable  # assembled in the client's own buffer
    assert np.array_equal(small, rows([[1, 2]]))


def test_chunked_threshold_counts_padding_and_dtype(fake: FakeServer) -> None:
    # Ragged padded: 2 x 10 rows x 8 x 2 bytes = 320 > 300; flat: 11 rows = 176 < 300.
    seqs = [list(range(10)), [1]]
    with client_for(fake, chunked_threshold_bytes=300) as client:
        client.embed(seqs, "float16")
        client.embed(seqs, "float16", layout="flat")
    assert [c.method for c in fake.service.calls][1:] == ["EmbedChunked", "Embed"]


def test_chunked_retries_a_stream_broken_midway(fake: FakeServer) -> None:
    fake.service.script.append(Abort(SC.UNAVAILABLE, "unavailable", after_chunks=2))
    ids = np.arange(100).reshape(2, 50)
    with client_for(fake, chunked_threshold_bytes=0, backoff_s=0.01) as client:
        hs = client.embed(ids)
    assert np.array_equal(hs, rows(ids))
    assert fake.service.count("EmbedChunked") == 2


# ---------------------------------------------------------------- EmbedStream


def test_stream_answers_in_order(fake: FakeServer) -> None:
    inputs = [[[1, 2]], [[3]], [[4, 5], [6]], np.array([7, 8, 9], np.int32)]
    with client_for(fake) as client:
        out = list(client.embed_stream(inputs))
    assert [o.shape for o in out] == [(1, 2, D), (1, 1, D), (2, 2, D), (1, 3, D)]
    assert np.array_equal(out[2][0], rows([4, 5]))
    assert np.array_equal(out[3], rows([[7, 8, 9]]))
    assert fake.service.count("EmbedStream") == 1
    assert fake.service.count("EmbedStream.item") == 4


def test_stream_error_raises_for_its_item(fake: FakeServer) -> None:
    inputs = [[[1]], [[2]], [[-1]], [[4]]]
    got: list[np.ndarray] = []
    with (
        client_for(fake) as client,
        pytest.raises(InvalidInputError, match="negative id") as info,
    ):
        for hs in client.embed_stream(inputs):
            got.append(hs)
    assert [g[0, 0, 0] for g in got] == [rows(1)[0], rows(2)[0]]
    assert info.value.code == SC.INVALID_ARGUMENT


def test_stream_return_exceptions_keeps_going(fake: FakeServer) -> None:
    inputs = [[[1]], [[-1]], [[1.5]], [[4]]]  # a server refusal, then a client refusal
    with client_for(fake) as client:
        out = list(client.embed_stream_results(inputs, return_exceptions=True))
    assert [type(o).__name__ for o in out] == [
        "EmbedResult",
        "InvalidInputError",
        "InvalidInputError",
        "EmbedResult",
    ]
    assert "negative id" in str(out[1])
    assert "float" in str(out[2])
    last = out[3]
    assert isinstance(last, EmbedResult)
    assert np.array_equal(last.hidden_states, rows([[4]]))
    assert fake.service.count("EmbedStream.item") == 3  # the float input never left


def test_stream_client_refusal_raises_in_turn(fake: FakeServer) -> None:
    got: list[np.ndarray] = []
    with client_for(fake) as client, pytest.raises(InvalidInputError, match="float"):
        for hs in client.embed_stream([[[1]], [[2]], [[0.5]], [[3]]]):
            got.append(hs)
    assert len(got) == 2


def test_stream_input_failure_reaches_the_caller(fake: FakeServer) -> None:
    class Boom(Exception):
        pass

    def inputs() -> Iterator[list[list[int]]]:
        yield [[1]]
        raise Boom("the input source broke")

    with client_for(fake) as client, pytest.raises(Boom, match="input source"):
        list(client.embed_stream(inputs()))


def test_stream_input_failure_comes_after_earlier_items(fake: FakeServer) -> None:
    class Boom(Exception):
        pass

    def inputs() -> Iterator[Any]:
        yield [[1]]
        yield [[0.5]]  # refused by the client
        raise Boom("late")

    got: list[Any] = []
    with client_for(fake) as client, pytest.raises(Boom, match="late"):
        for item in client.embed_stream_results(inputs(), return_exceptions=True):
            got.append(item)
    assert [type(g) for g in got] == [EmbedResult, InvalidInputError]


def test_stream_against_a_stopped_server() -> None:
    with client_for(f"127.0.0.1:{free_port()}") as client, pytest.raises(UnavailableError):
        list(client.embed_stream([[[1]]]))


# ---------------------------------------------------------------- health


def test_health(fake: FakeServer) -> None:
    with client_for(fake) as client:
        assert client.health() == "SERVING"
        fake.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert client.health() == "NOT_SERVING"
        assert client.health("tokembed.v1.EmbeddingService") == "SERVING"
        assert client.health("no.such.Service") == "SERVICE_UNKNOWN"


def test_health_of_a_stopped_server() -> None:
    with client_for(f"127.0.0.1:{free_port()}") as client, pytest.raises(UnavailableError):
        client.health(timeout_s=2)


def test_health_without_the_package(fake: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "grpc_health.v1", None)  # import now fails
    with (
        client_for(fake) as client,
        pytest.raises(EmbeddingError, match="pip install grpcio-health-checking"),
    ):
        client.health()


# ---------------------------------------------------------------- auth, TLS


def test_bearer_token_is_sent(fake: FakeServer) -> None:
    fake.service.required_token = "s3cret"
    with client_for(fake, token="s3cret\n", chunked_threshold_bytes=None) as client:
        assert client.embed([[1]]).shape == (1, 1, D)
    assert fake.service.calls[-1].metadata["authorization"] == "Bearer s3cret"
    with (
        client_for(fake, token="wrong", chunked_threshold_bytes=None, retries=3) as client,
        pytest.raises(AuthenticationError) as info,
    ):
        client.embed([[1]])
    assert info.value.code == SC.UNAUTHENTICATED
    with (
        client_for(fake, chunked_threshold_bytes=None) as client,
        pytest.raises(AuthenticationError),
    ):
        client.embed([[1]])


def test_bad_tokens_are_refused() -> None:
    for token in ("", "two words", "tab\there"):
        with pytest.raises(EmbeddingError, match="token"):
            EmbeddingClient("127.0.0.1:1", token=token)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_certificates(tmp_path_factory.mktemp("certs"))


def test_tls(fake_factory: Callable[..., FakeServer], certs: dict[str, Path]) -> None:
    creds = grpc.ssl_server_credentials(
        [(certs["server_key"].read_bytes(), certs["server_cert"].read_bytes())]
    )
    server = fake_factory(credentials=creds)
    with client_for(server, root_certificates=certs["ca"]) as client:
        assert np.array_equal(client.embed(SENTENCE), rows(SENTENCE))
    # A plaintext client gets no answer from a TLS port.
    with client_for(server, retries=0) as client, pytest.raises(UnavailableError):
        client.embed([[1]], timeout_s=3)
    # PEM bytes work as well as paths.
    with client_for(server, root_certificates=certs["ca"].read_bytes()) as client:
        assert client.health() == "SERVING"


def test_mutual_tls(fake_factory: Callable[..., FakeServer], certs: dict[str, Path]) -> None:
    creds = grpc.ssl_server_credentials(
        [(certs["server_key"].read_bytes(), certs["server_cert"].read_bytes())],
        root_certificates=certs["ca"].read_bytes(),
        require_client_auth=True,
    )
    server = fake_factory(credentials=creds)
    with client_for(
        server,
        root_certificates=certs["ca"],
        client_certificate=certs["client_cert"],
        client_key=certs["client_key"],
        token="t",
    ) as client:
        assert client.embed([[3]]).shape == (1, 1, D)
    with (
        client_for(server, root_certificates=certs["ca"], retries=0) as client,
        pytest.raises(UnavailableError),
    ):
        client.embed([[1]], timeout_s=3)


def test_tls_options_are_checked(certs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(EmbeddingError, match="both client_certificate and client_key"):
        EmbeddingClient("127.0.0.1:1", client_certificate=certs["client_cert"])
    with pytest.raises(EmbeddingError, match="cannot read root certificates"):
        EmbeddingClient("127.0.0.1:1", root_certificates=tmp_path / "missing.pem")


# ---------------------------------------------------------------- load balancing


def _spread(servers: list[FakeServer]) -> list[int]:
    return [s.service.count("Embed") for s in servers]


def test_round_robin_spreads_over_all_addresses(fake_factory: Callable[..., FakeServer]) -> None:
    servers = [fake_factory() for _ in range(3)]
    target = "ipv4:" + ",".join(s.address for s in servers)
    with client_for(target, load_balancing_policy="round_robin") as client:
        # round_robin picks among the connections already made: warm up until all are.
        deadline = time.monotonic() + 10
        while min(_spread(servers)) == 0:
            assert time.monotonic() < deadline, _spread(servers)
            client.embed([[1]])
        warm = _spread(servers)
        for _ in range(60):
            client.embed([[1]])
    counts = [after - before for after, before in zip(_spread(servers), warm, strict=True)]
    assert sum(counts) == 60
    assert min(counts) >= 10, counts  # pick_first would give [0, 0, 60]


def test_without_round_robin_one_address_gets_everything(
    fake_factory: Callable[..., FakeServer],
) -> None:
    servers = [fake_factory() for _ in range(2)]
    target = "ipv4:" + ",".join(s.address for s in servers)
    with client_for(target) as client:
        for _ in range(10):
            client.embed([[1]])
    assert sorted(_spread(servers)) == [0, 10]  # pick_first: why round_robin is needed


def test_round_robin_fails_over_when_a_replica_goes(
    fake_factory: Callable[..., FakeServer],
) -> None:
    servers = [fake_factory() for _ in range(3)]
    target = "ipv4:" + ",".join(s.address for s in servers)
    with client_for(target, load_balancing_policy="round_robin", backoff_s=0.02) as client:
        for _ in range(9):
            client.embed([[1]])
        servers[0].stop()
        for _ in range(30):
            assert client.embed([[2]]).shape == (1, 1, D)
    assert servers[1].service.count("Embed") + servers[2].service.count("Embed") >= 30


def test_dns_target_with_round_robin(fake: FakeServer) -> None:
    with client_for(f"dns:///127.0.0.1:{fake.port}", load_balancing_policy="round_robin") as c:
        assert np.array_equal(c.embed(SENTENCE), rows(SENTENCE))


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(EmbeddingError, match="load_balancing_policy"):
        EmbeddingClient("127.0.0.1:1", load_balancing_policy="random")


# ---------------------------------------------------------------- lifecycle


def test_closed_client_refuses_calls(fake: FakeServer) -> None:
    with client_for(fake) as client:
        client.embed([[1]])
    with pytest.raises(EmbeddingError, match="closed"):
        client.embed([[1]])
    client.close()  # idempotent


def test_threads_share_one_client(fake: FakeServer) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with client_for(fake) as client, ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: client.embed([[i, i + 1]]), range(40)))
    for i, hs in enumerate(outs):
        assert np.array_equal(hs, rows([[i, i + 1]]))
