"""EmbeddingClient against the real server, answers checked by value against the reference
rows (exact for float32; float16 is the reference cast with ``astype(np.float16)``).

What the client asked for is read from the server's own count of the RPCs it finished
(``client_support.requests_of``). EmbedStream: test_client_stream.py; TLS, tokens and load
balancing: test_client_connections.py. Retries, backoff and the overall deadline, measured
per attempt, and replies that break the protocol need failures on cue that only a scripted
fake gives: test_client_scripted.py.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from client_support import (
    SENTENCE,
    SMALL_NAME,
    HeldServer,
    LoadingServer,
    client_for,
    rejections,
    requests_of,
)

from tokembed.client import (
    AuthenticationError,
    DeadlineExceededError,
    EmbeddingError,
    EmbedResult,
    InvalidInputError,
    ModelNotFoundError,
    OverloadedError,
    RequestTooLargeError,
    ServerError,
    UnavailableError,
)

from support.backends import HOLDABLE, HookedLoader
from support.fixtures import PAD_D, PAD_ID, SMALL_D, SMALL_PAD, SMALL_V
from support.models import padded
from support.ports import free_port
from support.server import ServerThread, wait_for

SC = grpc.StatusCode
Start = Callable[..., ServerThread]


# ---------------------------------------------------------------- the happy paths


def test_embed_the_sentence(real_server: ServerThread, small_rows: np.ndarray) -> None:
    with client_for(real_server) as client:
        hs = client.embed(SENTENCE)
    assert hs.shape == (1, 8, SMALL_D)
    assert hs.dtype == np.float32
    np.testing.assert_array_equal(hs, small_rows[SENTENCE])
    assert not hs.flags.writeable  # zero-copy view of the reply


def test_the_first_embed_to_a_model_asks_nothing_else(real_server: ServerThread) -> None:
    """The model's D (for the chunked choice) is learnt from its first answer: no
    GetModelInfo round trip first, so a refusal is counted as the Embed it was."""
    with client_for(real_server) as client:
        client.embed([[1, 2]])
        client.embed([[3]])
    assert requests_of(real_server, "GetModelInfo") == 0
    assert requests_of(real_server, "Embed") == 2


def test_no_model_info_when_chunking_is_off(real_server: ServerThread) -> None:
    with client_for(real_server, chunked_threshold_bytes=None) as client:
        client.embed([[1, 2]])
    assert requests_of(real_server, "GetModelInfo") == 0
    assert requests_of(real_server, "Embed") == 1


def test_int32_ids(real_server: ServerThread, small_rows: np.ndarray) -> None:
    ids = np.array([[1, 2, SMALL_V - 1, 0]], dtype=np.int32)
    with client_for(real_server) as client:
        hs = client.embed(ids)
    np.testing.assert_array_equal(hs, small_rows[ids.astype(np.int64)])


def test_ragged_is_padded_with_the_padding_ids_row_and_flat_has_none(
    start_server: Start, pad_model_dir: Path, pad_rows: np.ndarray
) -> None:
    server = start_server(pad_model_dir)
    seqs = [[1, 2, 3], [4], [5, 6]]
    want = padded(pad_rows, seqs, pad_rows[PAD_ID])  # a row that is not zeros
    with client_for(server) as client:
        assert client.info().padding_id == PAD_ID
        result = client.embed_result(seqs)
        half = client.embed(seqs, "float16")
        flat = client.embed_result(seqs, layout="flat")
        rect_flat = client.embed([[1, 2], [3, 4]], layout="flat")
    np.testing.assert_array_equal(result.hidden_states, want)
    assert result.lengths is not None and result.lengths.tolist() == [3, 1, 2]
    for seq, part in zip(seqs, result.sequences(), strict=True):
        np.testing.assert_array_equal(part, pad_rows[seq])
    assert half.dtype == np.float16
    np.testing.assert_array_equal(half, want.astype(np.float16))
    np.testing.assert_array_equal(flat.hidden_states, pad_rows[[1, 2, 3, 4, 5, 6]])
    assert flat.lengths is not None and flat.lengths.tolist() == [3, 1, 2]
    assert rect_flat.shape == (4, PAD_D)  # flat is [N, D] for rectangular input too
    np.testing.assert_array_equal(rect_flat, pad_rows[[1, 2, 3, 4]])


def test_ragged_on_the_small_model_and_without_a_padding_id(
    two_models: ServerThread, small_rows: np.ndarray, decoder_rows: np.ndarray
) -> None:
    seqs = [[1, 2], [3, 4, 5, 6], [7]]
    with client_for(two_models) as client:
        small = client.embed(seqs)
        decoder = client.embed(seqs, model="decoder")
        assert client.info("decoder").padding_id is None
    np.testing.assert_array_equal(small, padded(small_rows, seqs, small_rows[SMALL_PAD]))
    # No padding id: the proto says zeros.
    np.testing.assert_array_equal(decoder, padded(decoder_rows, seqs, np.zeros(1, np.float32)))


def test_float16(real_server: ServerThread, small_rows: np.ndarray) -> None:
    ids = np.arange(SMALL_V).reshape(10, -1)
    with client_for(real_server) as client:
        hs = client.embed(ids, "float16")
        result = client.embed_result([[1, 2, 3]], "float16")
    assert hs.dtype == np.float16
    np.testing.assert_array_equal(hs, small_rows[ids].astype(np.float16))
    np.testing.assert_array_equal(result.hidden_states, small_rows[[[1, 2, 3]]].astype(np.float16))


def test_embed_result_carries_server_metadata(
    real_server: ServerThread, small_rows: np.ndarray
) -> None:
    with client_for(real_server) as client:
        version = client.info().version
        result = client.embed_result([[1, 2]], request_id="req-42")
    assert isinstance(result, EmbedResult)
    assert (result.model_name, result.model_version, result.request_id) == (
        SMALL_NAME,
        version,
        "req-42",
    )
    np.testing.assert_array_equal(result.hidden_states, small_rows[[[1, 2]]])
    assert result.lengths is None
    timings = result.timings
    assert (timings.batch_requests, timings.batch_tokens) == (1, 2)
    assert timings.compute_seconds > 0 and timings.server_seconds >= timings.compute_seconds


def test_model_info(real_server: ServerThread, small_model_dir: Path) -> None:
    with client_for(real_server) as client:
        info = client.model_info()
    settings = real_server.settings
    assert (info.name, info.vocab_size, info.d_model, info.padding_id) == (
        SMALL_NAME, SMALL_V, SMALL_D, SMALL_PAD,
    )  # fmt: skip
    assert info.scale == pytest.approx(SMALL_D**0.5)
    assert info.input_dtypes == ("int64", "int32")
    assert info.output_dtypes == ("float32", "float16", "bfloat16")
    assert (info.execution_provider, info.backend) == ("CPUExecutionProvider", "table")
    onnx = (small_model_dir / "model.onnx").read_bytes()
    assert info.model_sha256 == hashlib.sha256(onnx).hexdigest()
    assert info.limits.max_message_bytes == settings.max_message_bytes
    assert info.limits.max_tokens_per_request == settings.max_tokens_per_request
    assert info.limits.max_batch_tokens == settings.max_batch_tokens
    with pytest.raises(AttributeError):
        info.name = "x"  # type: ignore[misc]  # frozen


def test_torch_like_input(real_server: ServerThread, small_rows: np.ndarray) -> None:
    class Tensorish:
        def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
            return np.array([[7, 8, 9]])

    with client_for(real_server) as client:
        np.testing.assert_array_equal(client.embed(Tensorish()), small_rows[[[7, 8, 9]]])


def test_invalid_input_is_refused_without_a_call(real_server: ServerThread) -> None:
    with (
        client_for(real_server, chunked_threshold_bytes=None) as client,
        pytest.raises(InvalidInputError, match="float"),
    ):
        client.embed([[1.5, 2.0]])
    assert real_server.metric("tokembed_requests_total") == 0  # no RPC at all


# ---------------------------------------------------------------- errors from the server


ERRORS: dict[str, tuple[type[EmbeddingError], grpc.StatusCode, str]] = {
    "invalid_input": (InvalidInputError, SC.INVALID_ARGUMENT, "input_ids[0,1] = 1000 is outside"),
    "too_large": (RequestTooLargeError, SC.RESOURCE_EXHAUSTED, "3 tokens, over the limit of 2"),
    "overloaded": (OverloadedError, SC.RESOURCE_EXHAUSTED, "server overloaded: 8 tokens queued"),
    "internal": (ServerError, SC.INTERNAL, "injected onnxruntime failure"),
    "unauthenticated": (AuthenticationError, SC.UNAUTHENTICATED, "missing or wrong bearer token"),
}


@pytest.mark.parametrize("reason", list(ERRORS))
def test_server_errors_are_typed_and_not_retried(
    reason: str,
    start_server: Start,
    small_model_dir: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    cls, code, words = ERRORS[reason]
    ids = [[1, 2, 3]]
    if reason == "invalid_input":
        server = start_server(small_model_dir)
        ids = [[1, SMALL_V]]
    elif reason == "too_large":
        server = start_server(small_model_dir, max_tokens_per_request=2)
    elif reason == "overloaded":
        held: HeldServer = request.getfixturevalue("held")
        held.fill_queue()
        server = held.server
    elif reason == "internal":
        loader = HookedLoader()
        server = start_server(small_model_dir, loader=loader, **HOLDABLE)
        assert loader.backend is not None
        loader.backend.fail_next = True
    else:
        (tmp_path / "token").write_text("s3cret\n")
        server = start_server(small_model_dir, auth_token_file=tmp_path / "token")
    with (
        client_for(server, retries=3, backoff_s=0.01, chunked_threshold_bytes=None) as client,
        pytest.raises(cls) as info,
    ):
        client.embed(ids)
    assert type(info.value) is cls
    assert (info.value.code, info.value.reason) == (code, reason)
    assert words in str(info.value)
    assert isinstance(info.value.__cause__, grpc.RpcError)
    assert info.value.attempts == 1
    assert rejections(server, reason) == 1  # not retried: the server refused it once


def test_model_name_mismatch(real_server: ServerThread, small_rows: np.ndarray) -> None:
    with (
        client_for(real_server, model_name="other-model", chunked_threshold_bytes=None) as client,
        pytest.raises(ModelNotFoundError, match="other-model") as info,
    ):
        client.embed([[1]])
    assert (info.value.code, info.value.reason) == (SC.NOT_FOUND, "not_found")
    assert f"this server serves '{SMALL_NAME}'" in str(info.value)
    with client_for(real_server, model_name=SMALL_NAME, chunked_threshold_bytes=None) as client:
        np.testing.assert_array_equal(client.embed([[1]]), small_rows[[[1]]])


# ---------------------------------------------------------------- retries and deadlines


def test_unavailable_while_loading_is_retried_until_served(
    loading: LoadingServer, small_rows: np.ndarray
) -> None:
    server = loading.server
    with (
        client_for(server, retries=1000, backoff_s=0.01, backoff_max_s=0.05) as client,
        ThreadPoolExecutor(1) as pool,
    ):
        call = pool.submit(client.embed, SENTENCE, timeout_s=60)
        # Refused at least once (the models are loading), the client retrying meanwhile.
        assert wait_for(lambda: requests_of(server, "Embed", code="UNAVAILABLE") >= 2, 30)
        loading.finish_loading()
        np.testing.assert_array_equal(call.result(60), small_rows[SENTENCE])
    assert requests_of(server, "GetModelInfo") == 0
    assert requests_of(server, "Embed", code="OK") == 1


def test_overload_is_retried_only_when_asked(held: HeldServer, small_rows: np.ndarray) -> None:
    held.fill_queue()
    ids = [[1, 2, 3]]  # 8 queued + 3 > 10: refused while the queue is held
    with (
        client_for(held.server, retries=3, backoff_s=0.01, chunked_threshold_bytes=None) as client,
        pytest.raises(OverloadedError) as info,
    ):
        client.embed(ids)
    assert info.value.attempts == 1
    assert rejections(held.server, "overloaded") == 1
    with (
        client_for(
            held.server, retries=1000, backoff_s=0.01, backoff_max_s=0.05, retry_on_overload=True,
            chunked_threshold_bytes=None,
        ) as client,
        ThreadPoolExecutor(1) as pool,
    ):  # fmt: skip
        call = pool.submit(client.embed, ids, timeout_s=60)
        # Refused, and retried: a second refusal of this call's.
        assert wait_for(lambda: rejections(held.server, "overloaded") >= 3, 30)
        held.release()
        np.testing.assert_array_equal(call.result(60), small_rows[ids])


def test_too_large_is_never_retried_even_with_retry_on_overload(
    start_server: Start, small_model_dir: Path
) -> None:
    server = start_server(small_model_dir, max_tokens_per_request=4)
    with (
        client_for(
            server, retries=3, backoff_s=0.01, retry_on_overload=True, chunked_threshold_bytes=None
        ) as client,
        pytest.raises(RequestTooLargeError) as info,
    ):
        client.embed([[1, 2, 3, 4, 5]])
    assert (info.value.reason, info.value.attempts) == ("too_large", 1)
    assert requests_of(server, "Embed") == 1


def test_a_held_answer_hits_the_deadline_and_is_not_retried(held: HeldServer) -> None:
    # The look-up waits at the gate, which stays shut: only the deadline can end the call.
    with (
        client_for(held.server, chunked_threshold_bytes=None, retries=3) as client,
        pytest.raises(DeadlineExceededError) as info,
    ):
        client.embed([[1]], timeout_s=0.3)
    assert info.value.code == SC.DEADLINE_EXCEEDED
    assert info.value.attempts == 1  # a deadline is not retried


def test_a_server_that_is_not_there_is_unavailable_after_retries() -> None:
    with (
        client_for(f"127.0.0.1:{free_port()}", retries=2, backoff_s=0.01) as client,
        pytest.raises(UnavailableError) as info,
    ):
        client.embed([[1]])
    # UNAVAILABLE, not the deadline's error: refused at once, each attempt.
    assert info.value.code == SC.UNAVAILABLE
    assert info.value.attempts == 3


# ---------------------------------------------------------------- message size, chunks


def test_large_reply_fits_the_default_receive_limit(
    real_server: ServerThread, small_rows: np.ndarray
) -> None:
    ids = (np.arange(24576) % SMALL_V).reshape(1, -1)  # 24576 * 64 * 4 = 6 MiB > gRPC's 4 MiB
    with client_for(real_server, chunked_threshold_bytes=None) as client:
        hs = client.embed(ids)
    assert hs.nbytes == 6 * 2**20
    np.testing.assert_array_equal(hs, small_rows[ids])


def test_receive_limit_is_the_clients_setting(real_server: ServerThread) -> None:
    ids = (np.arange(5000) % SMALL_V).reshape(1, -1)  # 5000 * 64 * 4 = 1.28 MB > 1 MiB
    with (
        client_for(
            real_server, max_message_bytes=2**20, chunked_threshold_bytes=None, retries=3
        ) as client,
        pytest.raises(RequestTooLargeError) as info,
    ):
        client.embed(ids)
    assert info.value.code == SC.RESOURCE_EXHAUSTED
    assert info.value.reason is None  # gRPC's own size check, not the server's refusal
    assert info.value.attempts == 1
    assert requests_of(real_server, "Embed") == 1  # the server answered; the client refused it


def test_large_outputs_go_chunked_transparently(
    start_server: Start, small_model_dir: Path, small_rows: np.ndarray
) -> None:
    server = start_server(small_model_dir, stream_chunk_bytes=4096)  # 13 chunks for 51200 B
    ids = np.arange(200).reshape(4, 50)  # 200 * 64 * 4 = 51200 bytes > 10000
    with client_for(server, chunked_threshold_bytes=10_000) as client:
        small = client.embed([[1, 2]])  # 512 bytes: unary (and the model's D learnt)
        chunked = client.embed_result(ids, request_id="big")
    np.testing.assert_array_equal(chunked.hidden_states, small_rows[ids])
    assert (chunked.request_id, chunked.model_name) == ("big", SMALL_NAME)
    assert chunked.hidden_states.flags.writeable  # assembled in the client's own buffer
    np.testing.assert_array_equal(small, small_rows[[[1, 2]]])
    assert wait_for(lambda: requests_of(server, "EmbedChunked") == 1, 10)
    assert requests_of(server, "Embed") == 1
    assert requests_of(server, "GetModelInfo") == 0


def test_a_large_first_call_goes_unary_and_teaches_the_client_d(
    start_server: Start, small_model_dir: Path, small_rows: np.ndarray
) -> None:
    """Before a model's D is known, a call cannot be sized: it goes unary (asking
    GetModelInfo first would cost every new client a round trip), and its answer teaches D."""
    server = start_server(small_model_dir, stream_chunk_bytes=4096)
    ids = np.arange(200).reshape(4, 50)
    with client_for(server, chunked_threshold_bytes=10_000) as client:
        first = client.embed(ids)
        second = client.embed(ids)
    np.testing.assert_array_equal(first, small_rows[ids])
    np.testing.assert_array_equal(second, small_rows[ids])
    assert not first.flags.writeable and second.flags.writeable
    assert wait_for(lambda: requests_of(server, "EmbedChunked") == 1, 10)
    assert requests_of(server, "Embed") == 1 and requests_of(server, "GetModelInfo") == 0


def test_chunked_threshold_counts_padding_and_dtype(
    real_server: ServerThread, small_rows: np.ndarray
) -> None:
    # float16 padded: 2 x 10 rows x 64 x 2 bytes = 2560 > 2000; flat: 11 rows = 1408 < 2000;
    # float32 flat: 2816 > 2000.
    seqs = [list(range(10)), [1]]
    with client_for(real_server, chunked_threshold_bytes=2000) as client:
        client.info()  # teaches the client the model's D
        half_padded = client.embed(seqs, "float16")
        assert wait_for(lambda: requests_of(real_server, "EmbedChunked") == 1, 10)
        half_flat = client.embed(seqs, "float16", layout="flat")
        assert requests_of(real_server, "Embed") == 1
        full_flat = client.embed(seqs, layout="flat")
        assert wait_for(lambda: requests_of(real_server, "EmbedChunked") == 2, 10)
    want = padded(small_rows, seqs, small_rows[SMALL_PAD])
    np.testing.assert_array_equal(half_padded, want.astype(np.float16))
    np.testing.assert_array_equal(half_flat, small_rows[[*range(10), 1]].astype(np.float16))
    np.testing.assert_array_equal(full_flat, small_rows[[*range(10), 1]])


# ---------------------------------------------------------------- health


def test_health(loading: LoadingServer) -> None:
    with client_for(loading.server) as client:
        assert client.health() == "NOT_SERVING"  # port open, models loading
        assert client.health("tokembed.v1.EmbeddingService") == "NOT_SERVING"
        assert client.health(SMALL_NAME) == "SERVICE_UNKNOWN"  # each model's: once loaded
        loading.finish_loading()
        assert client.health() == "SERVING"
        assert client.health("tokembed.v1.EmbeddingService") == "SERVING"
        assert client.health(SMALL_NAME) == "SERVING"
        assert client.health("no.such.Service") == "SERVICE_UNKNOWN"


def test_health_of_a_server_that_is_not_there() -> None:
    with client_for(f"127.0.0.1:{free_port()}") as client, pytest.raises(UnavailableError):
        client.health(timeout_s=10)


def test_health_without_the_package(
    real_server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "grpc_health.v1", None)  # import now fails
    with (
        client_for(real_server) as client,
        pytest.raises(EmbeddingError, match=r"pip install 'tokembed\[server\]'"),
    ):
        client.health()


# ---------------------------------------------------------------- lifecycle


def test_closed_client_refuses_calls(real_server: ServerThread) -> None:
    with client_for(real_server) as client:
        client.embed([[1]])
    with pytest.raises(EmbeddingError, match="closed"):
        client.embed([[1]])
    client.close()  # idempotent
    assert requests_of(real_server, "Embed") == 1


def test_threads_share_one_client(real_server: ServerThread, small_rows: np.ndarray) -> None:
    with client_for(real_server) as client, ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: client.embed([[i, i + 1]]), range(40)))
    for i, hs in enumerate(outs):
        np.testing.assert_array_equal(hs, small_rows[[[i, i + 1]]])
    assert requests_of(real_server, "Embed") == 40
