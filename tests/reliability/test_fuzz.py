"""Fuzzing: thousands of generated bad requests against a ``tokembed serve`` process,
with a stream of good requests checked for exact values at the same time.

Holds when the server never crashes, every bad request gets its non-OK status (the exact
code, with the server's own reason) within a bounded time, and every good request
succeeds with the right numbers. The generator is seeded (``TOKEMBED_FUZZ_SEED``) and
the count fixed (``TOKEMBED_FUZZ_COUNT``, default 6000), so a failure replays.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from fuzz_cases import MAX_OUTPUT_BYTES, MAX_TOKENS, BadCase, bad_cases
from reliability_support import (
    EMBED,
    EMBED_CHUNKED,
    EMBED_STREAM,
    GoodCase,
    channel_options,
    decode_response,
    describe,
    good_case,
    tensor_array,
)

from tokembed.v1 import embedding_pb2 as pb

from support.metrics import scrape, total
from support.requests import reason_of
from support.server import ServerProcess, serve_args

SEED = int(os.environ.get("TOKEMBED_FUZZ_SEED", "20260701"))
COUNT = int(os.environ.get("TOKEMBED_FUZZ_COUNT", "6000"))
CONCURRENCY = 64  # bad requests in flight at once
GOOD_WORKERS = 4  # concurrent loops of good requests
CALL_TIMEOUT_S = 30.0  # a hung call would surface as DEADLINE_EXCEEDED, a wrong code
LATENCY_BOUND_S = 10.0  # every bad request answered within this (measured, asserted)
STREAM_SHARE = 0.1  # of the bad cases, sent inside EmbedStream among good ones
CHUNKED_SHARE = 0.1  # sent to EmbedChunked


@pytest.fixture(scope="module")
def fuzzed_server(small_model_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        serve_args(
            small_model_dir,
            "--max-tokens-per-request",
            str(MAX_TOKENS),
            "--max-output-bytes-per-request",
            str(MAX_OUTPUT_BYTES),
        )
    ).start()
    try:
        yield server
    finally:
        server.kill()


@dataclass
class Tally:
    bad_latencies: list[float] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)  # bad requests answered wrongly
    codes: collections.Counter[str] = field(default_factory=collections.Counter)
    good_ok: int = 0
    good_failed: list[str] = field(default_factory=list)
    stream_items: int = 0


def _check_error(case: BadCase, code: grpc.StatusCode, reason: str | None, where: str) -> str:
    if code == case.code and reason == case.reason:
        return ""
    return f"{where} {case.category}: got {code.name}/{reason}, want {case.code.name}/{case.reason}"


async def _send_bad(channel: grpc.aio.Channel, case: BadCase, chunked: bool, tally: Tally) -> None:
    started = time.monotonic()
    try:
        if chunked:
            call = channel.unary_stream(EMBED_CHUNKED)(case.raw, timeout=CALL_TIMEOUT_S)
            async for _ in call:
                pass
        else:
            await channel.unary_unary(EMBED)(case.raw, timeout=CALL_TIMEOUT_S)
    except grpc.aio.AioRpcError as error:
        tally.bad_latencies.append(time.monotonic() - started)
        tally.codes[error.code().name] += 1
        problem = _check_error(
            case, error.code(), reason_of(error), "EmbedChunked" if chunked else "Embed"
        )
        if problem:
            tally.wrong.append(f"{problem} ({error.details()!r}, bytes {case.raw[:64]!r})")
        return
    tally.wrong.append(f"{case.category}: answered OK (bytes {case.raw[:64]!r})")


async def _send_stream(
    channel: grpc.aio.Channel,
    cases: list[BadCase],
    rng: random.Random,
    rows: np.ndarray,
    tally: Tally,
) -> None:
    """One EmbedStream with the bad cases among good ones: every answer checked in order."""
    items: list[BadCase | GoodCase] = []
    for case in cases:
        items.append(case)
        if rng.random() < 0.5:
            items.append(good_case(rng, rows))
    started = time.monotonic()
    call = channel.stream_stream(EMBED_STREAM)(
        iter([item.raw for item in items]), timeout=CALL_TIMEOUT_S
    )
    answers = [pb.EmbedStreamResponse.FromString(raw) async for raw in call]
    elapsed = time.monotonic() - started
    if len(answers) != len(items):
        tally.wrong.append(f"EmbedStream: {len(answers)} answers for {len(items)} requests")
        return
    for item, answer in zip(items, answers, strict=True):
        tally.stream_items += 1
        if isinstance(item, BadCase):
            tally.bad_latencies.append(elapsed)
            if answer.WhichOneof("result") != "error":
                tally.wrong.append(f"EmbedStream {item.category}: answered OK")
                continue
            code = grpc.StatusCode(
                next(c for c in grpc.StatusCode if c.value[0] == answer.error.code)
            )
            tally.codes[code.name] += 1
            problem = _check_error(item, code, answer.error.reason, "EmbedStream")
            if problem:
                tally.wrong.append(f"{problem} ({answer.error.message!r})")
        elif answer.WhichOneof("result") != "response":
            tally.good_failed.append(f"EmbedStream good item: {answer.error}")
        else:
            got = tensor_array(answer.response.hidden_states)
            if not np.array_equal(got, item.want):
                tally.good_failed.append("EmbedStream good item: wrong values")
            else:
                tally.good_ok += 1


async def _good_traffic(
    channel: grpc.aio.Channel, seed: int, stop: asyncio.Event, rows: np.ndarray, tally: Tally
) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        case = good_case(rng, rows)
        try:
            raw = await channel.unary_unary(EMBED)(case.raw, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            tally.good_failed.append(f"{error.code().name}: {error.details()}")
            continue
        if np.array_equal(decode_response(raw), case.want):
            tally.good_ok += 1
        else:
            tally.good_failed.append("wrong values")


async def _fuzz(target: str, cases: list[BadCase], rows: np.ndarray) -> Tally:
    tally = Tally()
    rng = random.Random(SEED + 1)
    channels = [grpc.aio.insecure_channel(target, options=channel_options()) for _ in range(4)]
    try:
        stop = asyncio.Event()
        good = [
            asyncio.ensure_future(
                _good_traffic(channels[i % len(channels)], SEED + 10 + i, stop, rows, tally)
            )
            for i in range(GOOD_WORKERS)
        ]
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(index: int, job: list[BadCase], kind: str) -> None:
            async with gate:
                channel = channels[index % len(channels)]
                if kind == "stream":
                    await _send_stream(channel, job, random.Random(SEED + 100 + index), rows, tally)
                else:
                    await _send_bad(channel, job[0], kind == "chunked", tally)

        jobs: list[tuple[list[BadCase], str]] = []
        for_streams: list[BadCase] = []
        for case in cases:
            draw = rng.random()
            if draw < STREAM_SHARE:
                for_streams.append(case)
            else:
                jobs.append(([case], "chunked" if draw < STREAM_SHARE + CHUNKED_SHARE else "unary"))
        while for_streams:
            size = rng.randint(1, 20)
            jobs.append((for_streams[:size], "stream"))
            for_streams = for_streams[size:]
        rng.shuffle(jobs)
        await asyncio.gather(*(one(i, job, kind) for i, (job, kind) in enumerate(jobs)))
        stop.set()
        await asyncio.gather(*good)
    finally:
        for channel in channels:
            await channel.close()
    return tally


def test_fuzzed_bad_requests_fail_alone_while_good_ones_stay_exact(
    fuzzed_server: ServerProcess, small_rows: np.ndarray
) -> None:
    cases = bad_cases(SEED, COUNT)
    assert len(cases) >= 5000
    assert len({case.category for case in cases}) == 9
    started = time.monotonic()
    tally = asyncio.run(_fuzz(fuzzed_server.target, cases, small_rows))
    elapsed = time.monotonic() - started
    print(
        f"\nfuzz seed={SEED}: {len(cases)} bad requests in {elapsed:.1f}s, codes "
        f"{dict(tally.codes)}, latency {describe(tally.bad_latencies)}; "
        f"{tally.good_ok} good requests exact, {len(tally.good_failed)} failed; "
        f"{tally.stream_items} stream items"
    )
    assert fuzzed_server.process is not None and fuzzed_server.process.poll() is None, (
        "the server died:\n" + fuzzed_server.output[-5000:]
    )
    assert not tally.wrong, f"{len(tally.wrong)} bad requests answered wrongly: {tally.wrong[:10]}"
    assert len(tally.bad_latencies) == len(cases)  # every one answered
    assert max(tally.bad_latencies) < LATENCY_BOUND_S, describe(tally.bad_latencies)
    assert not tally.good_failed, tally.good_failed[:10]
    assert tally.good_ok >= 50  # the good stream really ran alongside

    # The server's own count agrees: each bad request went through its status table.
    rejected = total(scrape(fuzzed_server.metrics_port), "tokembed_rejections_total")
    assert rejected == len(cases)
    assert "Traceback" not in fuzzed_server.output  # no unexpected failure was logged

    fuzzed_server.send_signal(signal.SIGTERM)
    assert fuzzed_server.wait(30) == 0
