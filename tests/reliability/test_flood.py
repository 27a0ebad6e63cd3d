"""Amplification and memory: per-request caps, the request-size cap, and a flood of
maximum-size requests against a ``tokembed serve`` process whose RSS is read from /proc.

An id costs 8 bytes in and D x 4 bytes out (256x at D=512). The caps that bound it:
max_tokens_per_request and max_output_bytes_per_request per request, and admission's
max_inflight_output_bytes over all admitted, unfinished requests; past that, callers get
RESOURCE_EXHAUSTED at once instead of a place in a queue.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from reliability_support import (
    EMBED,
    EMBED_CHUNKED,
    EMBED_STREAM,
    MiB,
    channel_options,
    decode_response,
    describe,
    peak_rss,
    percentile,
    rss,
    tensor_array,
    varint,
)

from tokembed.bench.plan import DEPLOYMENT_ENV
from tokembed.v1 import embedding_pb2 as pb

from support.fixtures import DEFAULT_D, DEFAULT_V
from support.metrics import matching, scrape, total, value
from support.requests import encode, reason_of
from support.server import ServerProcess, serve_args, wait_for

MAX_TOKENS = 16384
MAX_OUTPUT = MAX_TOKENS * DEFAULT_D * 4  # 32 MiB: one maximum-size float32 answer
MAX_INFLIGHT = 2 * MAX_OUTPUT  # 64 MiB: two maximum-size answers at a time
TABLE_BYTES = DEFAULT_V * DEFAULT_D * 4  # 62.5 MiB of float32 weights
FLOOD_S = 10.0
UNARY_CALLERS, CHUNKED_CALLERS, STREAM_CALLERS = 24, 4, 4
STREAM_REQUESTS = 8  # per stream, sent 0.3 s apart, read slowly
# What a flood may add over the warmed-up server (see the test for the derivation).
COPIES_PER_ANSWER = 3
FLOOD_SLACK = 64 * MiB


FLOOD_ARGS = (
    "--max-tokens-per-request",
    str(MAX_TOKENS),
    "--max-output-bytes-per-request",
    str(MAX_OUTPUT),
    "--max-inflight-output-bytes",
    str(MAX_INFLIGHT),
    "--grace-s",
    "5",
)


@pytest.fixture(scope="module")
def flood_server(default_model_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(serve_args(default_model_dir, *FLOOD_ARGS)).start()
    try:
        yield server
    finally:
        server.kill()


def _max_ids(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, DEFAULT_V, size=(1, MAX_TOKENS), dtype=np.int64)


def _call(
    target: str, raw: bytes, timeout_s: float = 60
) -> tuple[bytes | None, grpc.RpcError | None]:
    with grpc.insecure_channel(target, options=channel_options()) as channel:
        try:
            return channel.unary_unary(EMBED)(raw, timeout=timeout_s), None
        except grpc.RpcError as error:
            return None, error


def test_an_oversized_request_is_refused_before_it_is_decoded(
    flood_server: ServerProcess, default_rows: np.ndarray
) -> None:
    """48 MiB of one-byte ``lengths``: refused by the receive limit, which follows from
    max_tokens_per_request (8 bytes an id, <= 10 a length), not from the output limit.
    Decoded, such a request held ~30x its size (8-byte integers, twice) before
    validation could look at it: 100 MiB took the server to 3 GB."""
    assert flood_server.process is not None
    pid = flood_server.process.pid
    before = peak_rss(pid)
    size = 48 * MiB
    raw = b"\x12" + varint(size) + b"\x01" * size
    started = time.monotonic()
    reply, error = _call(flood_server.target, raw)
    elapsed = time.monotonic() - started
    assert reply is None and error is not None
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert elapsed < 10
    assert peak_rss(pid) - before < 16 * MiB, (before, peak_rss(pid))
    # The largest valid request (every id its own sequence: the most lengths) still fits.
    ids = _max_ids(1)
    reply, error = _call(
        flood_server.target,
        encode(ids.reshape(-1), lengths=[1] * MAX_TOKENS, layout=pb.RAGGED_LAYOUT_FLAT),
    )
    assert error is None and reply is not None
    np.testing.assert_array_equal(decode_response(reply), default_rows[ids.reshape(-1)])


def test_per_request_caps_hold_at_the_boundary(
    flood_server: ServerProcess, default_rows: np.ndarray
) -> None:
    target = flood_server.target
    ids = _max_ids(2)
    reply, error = _call(target, encode(ids))  # exactly the caps: 16384 tokens, 32 MiB
    assert error is None and reply is not None
    got = decode_response(reply)
    np.testing.assert_array_equal(got, default_rows[ids])

    over_tokens = np.concatenate([ids, [[7]]], axis=1)
    _, error = _call(target, encode(over_tokens))
    assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reason_of(error) == "too_large" and "16385 tokens" in (error.details() or "")

    # Padding amplifies: 8000 ids in 16 sequences, one long, would pad to [16, 7985, D],
    # a 262 MB answer, though the ids are within the token cap.
    lengths = [1] * 15 + [7985]
    flat = np.arange(sum(lengths), dtype=np.int64) % DEFAULT_V
    _, error = _call(target, encode(flat, lengths=lengths))
    assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reason_of(error) == "too_large" and "response would be" in (error.details() or "")
    # ... while the same ids laid out flat fit.
    reply, error = _call(target, encode(flat, lengths=lengths, layout=pb.RAGGED_LAYOUT_FLAT))
    assert error is None and reply is not None
    np.testing.assert_array_equal(decode_response(reply), default_rows[flat])


@dataclass
class FloodTally:
    ok_latencies: list[float] = field(default_factory=list)
    rejected_latencies: list[float] = field(default_factory=list)
    stream_ok: int = 0
    stream_rejected: int = 0
    unexpected: list[str] = field(default_factory=list)
    rss_samples: list[int] = field(default_factory=list)
    inflight_samples: list[float] = field(default_factory=list)
    queued_samples: list[float] = field(default_factory=list)


def _check_rows(got: np.ndarray, ids: np.ndarray, rows: np.ndarray, tally: FloodTally) -> None:
    # A few rows of each 32 MiB answer, exactly (the whole of it would cost the client
    # more CPU than the server's work).
    flat_ids = ids.reshape(-1)
    flat = got.reshape(-1, DEFAULT_D)
    for index in (0, flat_ids.size // 2, flat_ids.size - 1):
        if not np.array_equal(flat[index], rows[flat_ids[index]]):
            tally.unexpected.append(f"wrong row {index}")


async def _unary_caller(
    channel: grpc.aio.Channel,
    seed: int,
    chunked: bool,
    rows: np.ndarray,
    tally: FloodTally,
    streams_in: asyncio.Event,
) -> None:
    ids = _max_ids(seed)
    raw = encode(ids)
    await streams_in.wait()  # the slow streams' first requests go in first
    until = time.monotonic() + FLOOD_S
    while time.monotonic() < until:
        started = time.monotonic()
        try:
            if chunked:
                chunks = [
                    pb.EmbedChunk.FromString(c)
                    async for c in channel.unary_stream(EMBED_CHUNKED)(raw, timeout=60)
                ]
                header = chunks[0].header.hidden_states
                data = b"".join(c.data for c in chunks[1:])
                got = np.frombuffer(data, "<f4").reshape(list(header.shape))
            else:
                got = decode_response(await channel.unary_unary(EMBED)(raw, timeout=60))
        except grpc.aio.AioRpcError as error:
            if (
                error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                and reason_of(error) == "overloaded"
            ):
                tally.rejected_latencies.append(time.monotonic() - started)
                await asyncio.sleep(0.01)
            else:
                tally.unexpected.append(f"{error.code().name}: {error.details()}")
            continue
        tally.ok_latencies.append(time.monotonic() - started)
        _check_rows(got, ids, rows, tally)


async def _slow_stream_caller(
    channel: grpc.aio.Channel,
    seed: int,
    rows: np.ndarray,
    tally: FloodTally,
    streams_in: asyncio.Event,
) -> None:
    """Sends maximum-size requests a while apart and reads the answers late: the answers
    wait in the server, and must stay counted against the in-flight cap while they do.
    The first request goes alone; the rest once every stream's first is in."""
    ids = _max_ids(seed)
    raw = encode(ids)

    async def requests() -> object:
        yield raw
        await streams_in.wait()
        for _ in range(STREAM_REQUESTS - 1):
            await asyncio.sleep(0.3)
            yield raw

    call = channel.stream_stream(EMBED_STREAM)(requests(), timeout=60)
    await asyncio.sleep(2.0)
    try:
        async for answer_raw in call:
            answer = pb.EmbedStreamResponse.FromString(answer_raw)
            if answer.WhichOneof("result") == "response":
                tally.stream_ok += 1
                _check_rows(tensor_array(answer.response.hidden_states), ids, rows, tally)
            elif answer.error.reason == "overloaded":
                tally.stream_rejected += 1
            else:
                tally.unexpected.append(f"stream: {answer.error}")
            await asyncio.sleep(0.3)
    except grpc.aio.AioRpcError as error:
        tally.unexpected.append(f"stream {error.code().name}: {error.details()}")


def _sampler(pid: int, metrics_port: int, stop: threading.Event, tally: FloodTally) -> None:
    while not stop.wait(0.05):
        tally.rss_samples.append(rss(pid))
        text = scrape(metrics_port, timeout_s=5)
        tally.inflight_samples.append(value(text, "tokembed_inflight_output_bytes"))
        # Each model's (one is served).
        tally.queued_samples += [s.value for s in matching(text, "tokembed_queued_tokens")]


def _unsent_bytes(metrics_port: int) -> float:
    """Output bytes the server holds room for (answers admitted and not yet sent)."""
    return value(scrape(metrics_port, timeout_s=5), "tokembed_inflight_output_bytes")


def _stream_outcomes(metrics_port: int) -> float:
    """EmbedStream requests the server has answered or refused so far."""
    text = scrape(metrics_port, timeout_s=5)
    return total(text, "tokembed_requests_total", {"method": "EmbedStream"})


async def _when_streams_are_in(metrics_port: int, before: float, streams_in: asyncio.Event) -> None:
    """Set ``streams_in`` once every stream's first request has its outcome: with room for
    two answers, two are admitted (and held, read late) and the others refused, whatever
    the timing; then the unary flood starts, and the streams go on."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + 30

    def first_requests_done() -> float:
        return _stream_outcomes(metrics_port) - before

    while await loop.run_in_executor(None, first_requests_done) < STREAM_CALLERS:
        assert time.monotonic() < deadline, "the streams' first requests never got answers"
        await asyncio.sleep(0.02)
    streams_in.set()


async def _flood(server: ServerProcess, rows: np.ndarray, tally: FloodTally) -> None:
    channels = [
        grpc.aio.insecure_channel(server.target, options=channel_options()) for _ in range(8)
    ]
    streams_in = asyncio.Event()
    before = _stream_outcomes(server.metrics_port)  # the module's server may have served some
    rng = random.Random(3)
    try:
        callers = [
            _unary_caller(
                channels[i % 8], rng.getrandbits(32), i < CHUNKED_CALLERS, rows, tally, streams_in
            )
            for i in range(UNARY_CALLERS + CHUNKED_CALLERS)
        ]
        callers += [
            _slow_stream_caller(channels[i % 8], rng.getrandbits(32), rows, tally, streams_in)
            for i in range(STREAM_CALLERS)
        ]
        callers.append(_when_streams_are_in(server.metrics_port, before, streams_in))
        await asyncio.gather(*callers)
    finally:
        for channel in channels:
            await channel.close()


@pytest.mark.slow  # a soak of ~10 s each; `scripts/test --fast` leaves both out
def test_a_flood_of_maximum_size_requests_keeps_rss_bounded_and_is_refused_fast(
    flood_server: ServerProcess, default_rows: np.ndarray
) -> None:
    flood(flood_server, default_rows)


@pytest.mark.slow
def test_the_bound_holds_with_the_deployment_s_allocator_settings_too(
    default_model_dir: Path, default_rows: np.ndarray
) -> None:
    # As the images and the Kubernetes manifest run it (huge pages for glibc's blocks).
    server = ServerProcess(serve_args(default_model_dir, *FLOOD_ARGS), env=DEPLOYMENT_ENV)
    server.start()
    try:
        flood(server, default_rows)
    finally:
        server.kill()


def flood(server: ServerProcess, rows: np.ndarray) -> None:
    assert server.process is not None
    pid = server.process.pid
    # Warm up with maximum-size requests one at a time: onnxruntime's arena, gRPC and the
    # allocator reach their size for one such request; that is the baseline.
    for seed in (10, 11):
        reply, error = _call(server.target, encode(_max_ids(seed)))
        assert error is None and reply is not None
        del reply
    baseline = rss(pid)
    # The bound, derived: past the baseline, a flood can add
    # - the weight pages not touched yet: at most the whole float32 table, V x D x 4;
    # - the admitted answers: admission keeps their bytes <= max_inflight_output_bytes
    #   (a request alone may pass it, but here one is half of it), and each exists at
    #   most COPIES_PER_ANSWER = 3 times: onnxruntime's output rows, the encoded
    #   response bytes, gRPC's copy in its send buffers;
    # - the batch computing now: its Gather result before the scale, one batch's rows,
    #   at most max(max_batch_tokens, max_tokens_per_request) x D x 4 = MAX_OUTPUT here;
    # - FLOOD_SLACK for what grows with callers rather than answers: ~36 calls' 128 KiB
    #   requests, per-connection HTTP/2 buffers, thread stacks, allocator rounding.
    bound = baseline + TABLE_BYTES + COPIES_PER_ANSWER * MAX_INFLIGHT + MAX_OUTPUT + FLOOD_SLACK

    tally = FloodTally()
    stop = threading.Event()
    sampler = threading.Thread(target=_sampler, args=(pid, server.metrics_port, stop, tally))
    sampler.start()
    try:
        asyncio.run(_flood(server, rows, tally))
    finally:
        stop.set()
        sampler.join(10)
    peak = peak_rss(pid)
    # The flood over (its refusals, its slow readers), the next answer is exact, and whole.
    # Asked once the server has let go of every answer's room (it does when gRPC reports
    # the bytes sent, which may come after the caller has them): not refused for room.
    assert wait_for(lambda: _unsent_bytes(server.metrics_port) == 0, 30)
    ids = _max_ids(12)
    reply, error = _call(server.target, encode(ids))
    assert error is None and reply is not None, error
    np.testing.assert_array_equal(decode_response(reply), rows[ids])
    del reply
    print(
        f"\nflood {FLOOD_S:.0f}s: baseline {baseline / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB "
        f"(+{(peak - baseline) / MiB:.0f}), bound {bound / MiB:.0f} MiB; "
        f"ok {describe(tally.ok_latencies)}; rejected {describe(tally.rejected_latencies)}; "
        f"stream answers ok {tally.stream_ok} rejected {tally.stream_rejected}; "
        f"max in-flight bytes seen {max(tally.inflight_samples, default=0) / MiB:.0f} MiB"
    )
    assert server.process.poll() is None, server.output[-3000:]
    assert not tally.unexpected, tally.unexpected[:10]
    assert len(tally.ok_latencies) >= 5 and tally.rejected_latencies  # work done, excess refused
    assert tally.stream_ok >= 1 and tally.stream_rejected >= 1
    assert peak <= bound, f"peak RSS {peak / MiB:.0f} MiB over the bound {bound / MiB:.0f} MiB"
    # Admission held its own bound all along, and nothing piled up in the queue.
    assert tally.inflight_samples and max(tally.inflight_samples) <= MAX_INFLIGHT
    assert max(tally.queued_samples, default=0) <= 2 * MAX_TOKENS
    # Refusals come fast, not after a wait in a queue: bounded, and quicker than the
    # answers themselves (compared side by side: the machine is shared and noisy).
    assert max(tally.rejected_latencies) < 5.0, describe(tally.rejected_latencies)
    assert percentile(tally.rejected_latencies, 50) < percentile(tally.ok_latencies, 50)
