"""The numbers are true: known traffic against a real server, then the exact values.

Each test starts its own server (its own registry), sends traffic whose effect on every
counter is known in advance, and asserts the exact increments and histogram counts.
Batches are made deterministic with a valve in front of the runtime: while one batch is
held inside the look-up, whatever is sent next waits in the queue, and opening the valve
releases it as one batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from tokembed.server.edge.v1.servicer import FRONT_END
from tokembed.server.observability.metrics import REJECTION_REASONS
from tokembed.v1 import embedding_pb2 as pb

from support.backends import Gate
from support.fixtures import SMALL_D
from support.metrics import matching, samples, scrape
from support.requests import embed_request, ids_of, reason_of, stub_for
from support.server import ServerThread, wait_for

ROW_BYTES = SMALL_D * 4  # one float32 row of the small model
# A histogram bucket's bound that sets apart the times of held look-ups and of waits behind
# them (each at least HOLD_S, by construction) from ordinary ones: those take well under
# 10 ms, and a busy core stretched none past 0.1 s on the 2-core development machine.
QUICK_S = 0.5
HOLD_S = 0.6  # how long a test keeps requests queued behind a held batch: beyond QUICK_S
# How long a request may take to reach the server's queue behind a held batch, and so its
# deadline when it is to expire there: ~1 ms, far longer on a busy core, never near this.
REACH_QUEUE_S = 3.0


def requests_by_code(server: ServerThread, method: str) -> dict[str, float]:
    """{code: count} of tokembed_requests_total for one method (over every model label),
    as a scrape shows it; codes counted 0 left out."""
    text = scrape(server.metrics_port)
    counts: dict[str, float] = {}
    for sample in matching(text, "tokembed_requests_total", {"method": method}):
        counts[sample.labels["code"]] = counts.get(sample.labels["code"], 0) + sample.value
    return {code: count for code, count in counts.items() if count}


def rejections(server: ServerThread) -> dict[str, float]:
    """{reason: count} of tokembed_rejections_total, zero entries left out."""
    counts = {
        r: server.metric("tokembed_rejections_total", {"reason": r}) for r in REJECTION_REASONS
    }
    return {reason: count for reason, count in counts.items() if count}


def assert_each_failure_counted_once(server: ServerThread) -> None:
    """Every failed RPC is one rejection, and every rejection one failed RPC."""
    failed = sum(
        sample.value
        for sample in matching(scrape(server.metrics_port), "tokembed_requests_total")
        if sample.labels["code"] != "OK"
    )
    assert sum(rejections(server).values()) == failed


def test_known_traffic_gives_exact_counts(
    small_model_dir: Path, start_server: Callable[..., ServerThread]
) -> None:
    """37 valid requests of 8 tokens and 3 invalid ones, sent one after another."""
    server = start_server(small_model_dir)
    m = server.metric
    invalid = [
        embed_request([[1, 2, 1000]]),  # id == V
        embed_request([[5, -1, 6]]),  # negative id
        # shape [1, 4] but the bytes of 3 ids
        embed_request(shape=[1, 4], data=bytes(24)),
    ]
    with stub_for(server.target) as stub:
        replies = [stub.Embed(embed_request(ids_of(8, start=i)), timeout=10) for i in range(37)]
        for request in invalid:
            with pytest.raises(grpc.RpcError) as caught:
                stub.Embed(request, timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert reason_of(caught.value) == "invalid_input"

    assert requests_by_code(server, "Embed") == {"OK": 37, "INVALID_ARGUMENT": 3}
    assert rejections(server) == {"invalid_input": 3}
    assert m("tokembed_tokens_total") == 37 * 8 == 296
    returned = sum(len(reply.hidden_states.data) for reply in replies)
    assert m("tokembed_output_bytes_total") == returned == 37 * 8 * ROW_BYTES
    # Every RPC has a duration; only requests that reached the batcher waited or were encoded.
    assert m("tokembed_request_duration_seconds_count", {"method": "Embed"}) == 40
    assert m("tokembed_queue_wait_seconds_count") == 37
    assert m("tokembed_encode_seconds_count") == 37
    # One after another, each request finds the server idle and goes alone: 37 batches of
    # one request and 8 tokens. Invalid requests never reach a batch.
    assert m("tokembed_batches_total") == 37
    assert m("tokembed_compute_seconds_count") == 37
    assert m("tokembed_batch_requests_count") == 37
    assert m("tokembed_batch_requests_sum") == 37
    assert m("tokembed_batch_tokens_count") == 37
    assert m("tokembed_batch_tokens_sum") == 296
    assert m("tokembed_inflight_requests") == 0
    assert m("tokembed_queued_tokens") == 0
    assert_each_failure_counted_once(server)


def test_one_batch_of_n_requests_is_one_batch_and_n_requests(
    start_valved: Callable[..., ServerThread], valve: Gate
) -> None:
    n = 5
    server = start_valved()
    m = server.metric
    with stub_for(server.target) as stub:
        valve.close()
        blocker = stub.Embed.future(embed_request(ids_of(8)), timeout=30)
        assert valve.held.wait(10), "the first batch never reached the runtime"
        followers = [
            stub.Embed.future(embed_request(ids_of(8, start=10 * k)), timeout=30) for k in range(n)
        ]
        assert wait_for(lambda: m("tokembed_queued_tokens") == 8 * n, 10)
        # The gauges while held: every RPC in flight, the followers' tokens queued.
        assert m("tokembed_inflight_requests") == n + 1
        assert m("tokembed_batches_total") == 0  # the held batch has not finished
        time.sleep(HOLD_S)
        valve.open()
        first = blocker.result(10)
        replies = [future.result(10) for future in followers]

    assert first.timings.batch_requests == 1
    assert [reply.timings.batch_requests for reply in replies] == [n] * n
    assert [reply.timings.batch_tokens for reply in replies] == [8 * n] * n
    # Two batches: the held one (1 request) and the followers' (n requests).
    assert m("tokembed_batches_total") == 2
    assert m("tokembed_batch_requests_count") == 2
    assert m("tokembed_batch_requests_sum") == 1 + n
    assert m("tokembed_batch_requests_bucket", {"le": "1.0"}) == 1
    assert m("tokembed_batch_requests_bucket", {"le": "4.0"}) == 1  # n=5 is one observation
    assert m("tokembed_batch_requests_bucket", {"le": "8.0"}) == 2
    assert m("tokembed_batch_tokens_count") == 2
    assert m("tokembed_batch_tokens_sum") == 8 * (n + 1)
    assert m("tokembed_compute_seconds_count") == 2
    # ... and n + 1 requests, each counted on its own.
    assert requests_by_code(server, "Embed") == {"OK": n + 1}
    assert m("tokembed_queue_wait_seconds_count") == n + 1
    assert m("tokembed_tokens_total") == 8 * (n + 1)
    assert m("tokembed_output_bytes_total") == 8 * (n + 1) * ROW_BYTES
    # The times say where the time went: the held look-up counts as compute, the followers'
    # wait behind it as queue wait, both as request duration.
    quick = {"le": str(QUICK_S)}
    assert m("tokembed_compute_seconds_bucket", quick) == 1  # the followers' batch
    assert m("tokembed_compute_seconds_sum") >= HOLD_S
    assert m("tokembed_queue_wait_seconds_bucket", quick) == 1  # the first request
    assert m("tokembed_queue_wait_seconds_sum") >= n * HOLD_S
    assert m("tokembed_request_duration_seconds_bucket", {"method": "Embed", **quick}) == 0
    # And the gauges come back down.
    assert wait_for(lambda: m("tokembed_inflight_requests") == 0, 10)
    assert m("tokembed_queued_tokens") == 0


def test_every_method_is_counted_under_its_name(
    small_model_dir: Path, text_model_dir: Path, start_server: Callable[..., ServerThread]
) -> None:
    # The text methods go to a model with its own tokenizer ("text"); the rest to "small".
    server = start_server((small_model_dir, text_model_dir))
    small = {"model": "small"}

    def m(name: str, labels: dict[str, str] | None = None) -> float:
        return server.metric(name, {**small, **(labels or {})})

    stream_requests = [embed_request(ids_of(8, start=k)) for k in range(3)]
    stream_requests.insert(2, embed_request([[1, 1000]]))  # invalid, answered in-stream
    with stub_for(server.target) as stub:
        answers = list(stub.EmbedStream(iter(stream_requests), timeout=10))
        chunks = [
            list(stub.EmbedChunked(embed_request(ids_of(4, batch=2)), timeout=10)) for _ in range(2)
        ]
        # Ragged, padded to [2, 5]: 8 tokens, 10 rows returned.
        ragged = stub.Embed(embed_request(ids_of(8)[0], lengths=[3, 5]), timeout=10)
        stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        stub.ListModels(pb.ListModelsRequest(), timeout=10)
        with pytest.raises(grpc.RpcError):  # the small model has no head
            stub.Nearest(pb.NearestRequest(k=1), timeout=10)
        with pytest.raises(grpc.RpcError):
            list(stub.NearestChunked(pb.NearestRequest(k=1), timeout=10))
        tokenized = stub.Tokenize(pb.TokenizeRequest(texts=[b"hello world"], model_name="text"))
        embedded = stub.EmbedText(pb.EmbedTextRequest(texts=[b"a b", b"c"], model_name="text"))
        chunked_text = list(
            stub.EmbedTextChunked(pb.EmbedTextRequest(texts=[b"d e"], model_name="text"))
        )
        stub.Detokenize(pb.DetokenizeRequest(
            input_ids=pb.Tensor(dtype=pb.DTYPE_INT64, shape=[1, 2], data=bytes(16)),
            model_name="text",
        ))  # fmt: skip

    assert [answer.WhichOneof("result") for answer in answers] == [
        "response", "response", "error", "response",
    ]  # fmt: skip
    assert answers[2].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert list(ragged.hidden_states.shape) == [2, 5, SMALL_D]

    assert requests_by_code(server, "EmbedStream") == {"OK": 3, "INVALID_ARGUMENT": 1}
    assert requests_by_code(server, "EmbedChunked") == {"OK": 2}
    assert requests_by_code(server, "Embed") == {"OK": 1}
    assert requests_by_code(server, "GetModelInfo") == {"OK": 1}
    assert requests_by_code(server, "ListModels") == {"OK": 1}
    assert requests_by_code(server, "Nearest") == {"INVALID_ARGUMENT": 1}
    assert requests_by_code(server, "NearestChunked") == {"INVALID_ARGUMENT": 1}
    for method in ("Tokenize", "EmbedText", "EmbedTextChunked", "Detokenize"):
        assert requests_by_code(server, method) == {"OK": 1}, method
    text_tokens = sum(
        len(np.frombuffer(named.tensor.data, np.int64))
        for answer in (tokenized, embedded)
        for named in answer.tensors
        if named.name == "input_ids"
    )
    chunked_tokens = sum(
        int(np.prod(named.tensor.shape))
        for named in chunked_text[0].header.tensors
        if named.name == "input_ids"
    )
    assert chunked_tokens > 0
    assert server.metric("tokembed_tokens_total", {"model": "text"}) == (
        text_tokens + chunked_tokens + 2
    )
    counted = {
        sample.labels["method"]
        for sample in matching(scrape(server.metrics_port), "tokembed_requests_total")
        if sample.value
    }
    assert counted == set(FRONT_END.methods)
    assert rejections(server) == {"invalid_input": 3}
    # Tokens are the ids sent, not padded positions: 3x8 streamed, 2x8 chunked, 8 ragged.
    assert m("tokembed_tokens_total") == 24 + 16 + 8
    streamed = sum(
        len(answer.response.hidden_states.data) for answer in answers if answer.HasField("response")
    )
    chunked = sum(len(chunk.data) for call in chunks for chunk in call)
    returned = streamed + chunked + len(ragged.hidden_states.data)
    assert returned == (24 + 16 + 10) * ROW_BYTES
    assert m("tokembed_output_bytes_total") == returned
    assert m("tokembed_batches_total") == 3 + 2 + 1
    assert m("tokembed_queue_wait_seconds_count") == 3 + 2 + 1
    for method, count in (("EmbedStream", 4), ("EmbedChunked", 2), ("Embed", 1)):
        assert m("tokembed_request_duration_seconds_count", {"method": method}) == count
    assert m("tokembed_request_duration_seconds_count", {"method": "GetModelInfo"}) == 1
    assert_each_failure_counted_once(server)


def test_too_large_is_counted_apart_from_overloaded(
    small_model_dir: Path, start_server: Callable[..., ServerThread]
) -> None:
    # 64 tokens a request; 8192 output bytes = 32 float32 rows or 64 float16 rows at D=64.
    # No float16 table: float16 answers go through the batcher like the others here.
    server = start_server(
        small_model_dir,
        max_tokens_per_request=64,
        max_output_bytes_per_request=8192,
        float16_table_max_bytes=0,
    )
    m = server.metric
    with stub_for(server.target) as stub:
        for request in (
            embed_request(ids_of(65)),  # too many tokens
            embed_request(ids_of(40)),  # 40 rows x 256 bytes: too many output bytes
        ):
            with pytest.raises(grpc.RpcError) as caught:
                stub.Embed(request, timeout=10)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert reason_of(caught.value) == "too_large"
        at_limit = stub.Embed(embed_request(ids_of(32)), timeout=10)
        half = stub.Embed(embed_request(ids_of(40), output_dtype=pb.DTYPE_FLOAT16), timeout=10)

    assert requests_by_code(server, "Embed") == {"OK": 2, "RESOURCE_EXHAUSTED": 2}
    assert rejections(server) == {"too_large": 2}
    assert m("tokembed_tokens_total") == 32 + 40
    returned = len(at_limit.hidden_states.data) + len(half.hidden_states.data)
    assert m("tokembed_output_bytes_total") == returned == 8192 + 40 * SMALL_D * 2
    # Refused requests never reach a batch.
    assert m("tokembed_batches_total") == 2
    assert m("tokembed_batch_tokens_sum") == 32 + 40
    assert_each_failure_counted_once(server)


def test_float16_answers_count_as_requests_and_batches_as_float32_ones_do(
    small_model_dir: Path, start_server: Callable[..., ServerThread]
) -> None:
    """Every look-up is reported as a batch from one place, whatever its dtype: float16
    answers from the float16 table too (each a batch of one: a table does not batch)."""
    server = start_server(small_model_dir)  # the 128 KB float16 table is kept by default
    m = server.metric
    with stub_for(server.target) as stub:
        halves = [
            stub.Embed(embed_request(ids_of(8, start=k), output_dtype=pb.DTYPE_FLOAT16), timeout=10)
            for k in range(3)
        ]
        full = stub.Embed(embed_request(ids_of(8)), timeout=10)

    assert requests_by_code(server, "Embed") == {"OK": 4}
    assert m("tokembed_tokens_total") == 32
    returned = sum(len(r.hidden_states.data) for r in [*halves, full])
    assert m("tokembed_output_bytes_total") == returned == 3 * 8 * SMALL_D * 2 + 8 * ROW_BYTES
    assert m("tokembed_queue_wait_seconds_count") == 4
    assert m("tokembed_batches_total") == 4
    assert m("tokembed_compute_seconds_count") == 4
    assert m("tokembed_batch_tokens_sum") == 32
    assert m("tokembed_batch_requests_sum") == 4


def test_overloaded_is_counted_once_per_refusal(
    start_valved: Callable[..., ServerThread], valve: Gate
) -> None:
    server = start_valved(max_queued_tokens=16)
    m = server.metric
    with stub_for(server.target) as stub:
        valve.close()
        blocker = stub.Embed.future(embed_request(ids_of(8)), timeout=30)
        assert valve.held.wait(10)
        queued = [stub.Embed.future(embed_request(ids_of(8, start=k)), timeout=30) for k in (1, 2)]
        assert wait_for(lambda: m("tokembed_queued_tokens") == 16, 10)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            stub.Embed(embed_request(ids_of(8, start=3)), timeout=30)
        refused_after = time.monotonic() - started
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert reason_of(caught.value) == "overloaded"
        assert refused_after < 5, "an overloaded server refuses at once, it does not queue"
        assert rejections(server) == {"overloaded": 1}
        assert m("tokembed_queued_tokens") == 16
        valve.open()
        blocker.result(10)
        for future in queued:
            future.result(10)

    assert requests_by_code(server, "Embed") == {"OK": 3, "RESOURCE_EXHAUSTED": 1}
    assert rejections(server) == {"overloaded": 1}
    assert m("tokembed_batches_total") == 2  # the held one, then the two queued together
    assert m("tokembed_batch_requests_sum") == 3
    assert_each_failure_counted_once(server)


def test_deadline_exceeded_while_queued_is_counted_once(
    start_valved: Callable[..., ServerThread], valve: Gate
) -> None:
    server = start_valved()
    m = server.metric
    with stub_for(server.target) as stub:
        valve.close()
        blocker = stub.Embed.future(embed_request(ids_of(8)), timeout=30)
        assert valve.held.wait(10)
        late = stub.Embed.future(embed_request(ids_of(8, start=1)), timeout=REACH_QUEUE_S)
        # Queued before its deadline, so that it expires in the queue (else the test is void).
        queued = wait_for(lambda: m("tokembed_queued_tokens") == 8, REACH_QUEUE_S)
        assert queued, "not queued before its deadline"
        error = late.exception(10)
        assert isinstance(error, grpc.RpcError)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The server learns of the deadline on its own clock, a moment after the client.
        assert wait_for(lambda: m("tokembed_rejections_total", {"reason": "deadline_exceeded"}), 5)
        assert rejections(server) == {"deadline_exceeded": 1}
        assert requests_by_code(server, "Embed") == {"DEADLINE_EXCEEDED": 1}
        assert wait_for(lambda: m("tokembed_inflight_requests") == 1, 5)  # the held one
        valve.open()
        blocker.result(10)

    # The expired request is dropped before compute: one batch, the held one.
    dropped = {"reason": "deadline_exceeded"}
    assert wait_for(lambda: m("tokembed_batcher_dropped_total", dropped) == 1, 5)
    assert m("tokembed_batches_total") == 1
    assert rejections(server) == {"deadline_exceeded": 1}  # still once
    assert requests_by_code(server, "Embed") == {"OK": 1, "DEADLINE_EXCEEDED": 1}
    assert m("tokembed_queued_tokens") == 0
    assert wait_for(lambda: m("tokembed_inflight_requests") == 0, 5)
    assert_each_failure_counted_once(server)


def test_cancelled_while_queued_is_counted_once(
    start_valved: Callable[..., ServerThread], valve: Gate
) -> None:
    server = start_valved()
    m = server.metric
    with stub_for(server.target) as stub:
        valve.close()
        blocker = stub.Embed.future(embed_request(ids_of(8)), timeout=30)
        assert valve.held.wait(10)
        leaving = stub.Embed.future(embed_request(ids_of(8, start=1)), timeout=30)
        assert wait_for(lambda: m("tokembed_queued_tokens") == 8, 10)
        assert m("tokembed_inflight_requests") == 2
        assert leaving.cancel()
        assert wait_for(lambda: m("tokembed_rejections_total", {"reason": "cancelled"}), 5)
        assert rejections(server) == {"cancelled": 1}
        assert requests_by_code(server, "Embed") == {"CANCELLED": 1}
        valve.open()
        blocker.result(10)

    dropped = {"reason": "cancelled"}
    assert wait_for(lambda: m("tokembed_batcher_dropped_total", dropped) == 1, 5)
    assert m("tokembed_batches_total") == 1
    assert rejections(server) == {"cancelled": 1}
    assert requests_by_code(server, "Embed") == {"OK": 1, "CANCELLED": 1}
    assert m("tokembed_queued_tokens") == 0
    assert wait_for(lambda: m("tokembed_inflight_requests") == 0, 5)
    assert_each_failure_counted_once(server)


def test_known_traffic_numbers_are_what_a_scrape_shows(
    small_model_dir: Path, start_server: Callable[..., ServerThread]
) -> None:
    """The HTTP endpoint serves the same registry the server counts on."""
    server = start_server(small_model_dir)
    assert server.metrics_port != server.port
    with stub_for(server.target) as stub:
        for k in range(7):
            stub.Embed(embed_request(ids_of(3, start=k)), timeout=10)
    found = samples(scrape(server.metrics_port))
    small = ("model", "small")
    # A call's series name its protocol and operation too (labels sorted by name).
    embed = (("method", "Embed"), small, ("operation", "embed"), ("protocol", "tokembed.v1"),
             ("version", "1"))  # fmt: skip
    assert found[("tokembed_requests_total", (("code", "OK"), *embed))] == 7
    assert found[("tokembed_tokens_total", (small,))] == 21
    assert found[("tokembed_batch_tokens_sum", (small,))] == 21
    assert found[("tokembed_output_bytes_total", (small,))] == 21 * ROW_BYTES
    assert np.isclose(
        found[("tokembed_request_duration_seconds_sum", embed)],
        server.metric("tokembed_request_duration_seconds_sum", {"method": "Embed"}),
    )
