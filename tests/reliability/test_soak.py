"""Load: a bounded soak of mixed shapes at concurrency 64 against ``tokembed serve``.

Holds with zero unexpected errors, every answer exact, and the server's RSS growing
less than 5% from the first third of the soak to the last (a leak grows steadily; a
server that merely warmed up does not). The thirds are measured after a minute of
warm-up at the same load.

The CI form runs 30 s. The long form (3 minutes in the issue) is opt-in, because
.ci/run runs the slow tests too: ``TOKEMBED_SOAK_S=180 pytest -m slow tests/reliability``.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections import Counter
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
    rss,
    tensor_array,
)

from tokembed.v1 import embedding_pb2 as pb

from support.fixtures import DEFAULT_D, DEFAULT_V
from support.models import padded
from support.requests import encode
from support.server import ServerProcess, serve_args

CI_SOAK_S = 30.0
LONG_SOAK_S = float(os.environ.get("TOKEMBED_SOAK_S", "0") or 0)
CONCURRENCY = 64
# Full load before the measured soak. Resident memory climbs for about a minute under
# this load before it levels off (onnxruntime's arena and malloc's arenas settle at the
# largest concurrent set of answers seen so far; measured: 410 MiB at 10 s, 450 MiB from
# 60 s to 120 s, flat after), which is not a leak; the thirds are measured after it. With
# 4 s or 10 s of warm-up instead, the 30 s form saw up to +8% and the 3-minute form +13%.
WARM_UP_S = 60.0
MAX_GROWTH = 0.05
SHAPES = [(1, 8), (1, 64), (4, 16), (8, 128), (2, 512), (16, 64), (1, 2048), (4, 1024)]


@pytest.fixture
def soak_server(default_model_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(serve_args(default_model_dir, "--grace-s", "5")).start()
    try:
        yield server
    finally:
        server.kill()


@dataclass
class SoakTally:
    ok: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Mixed:
    raw: bytes
    want: np.ndarray
    method: str


def _mixed(rng: random.Random, rows: np.ndarray) -> Mixed:
    np_rng = np.random.default_rng(rng.getrandbits(32))
    half = rng.random() < 0.25
    output = pb.DTYPE_FLOAT16 if half else pb.DTYPE_FLOAT32
    if rng.random() < 0.25:  # ragged, flat or padded
        lengths = [rng.randint(1, 256) for _ in range(rng.randint(1, 8))]
        ids = np_rng.integers(0, DEFAULT_V, size=sum(lengths), dtype=np.int64)
        flat = rng.random() < 0.5
        layout = pb.RAGGED_LAYOUT_FLAT if flat else pb.RAGGED_LAYOUT_PADDED
        raw = encode(ids, lengths=lengths, layout=layout, output_dtype=output)
        if flat:
            want = rows[ids]
        else:  # this model has no padding id: padded positions are zeros
            offsets = np.cumsum([0, *lengths])
            seqs = [ids[offsets[i] : offsets[i + 1]] for i in range(len(lengths))]
            want = padded(rows, seqs, np.zeros(DEFAULT_D, np.float32))
    else:
        ids = np_rng.integers(0, DEFAULT_V, size=rng.choice(SHAPES), dtype=np.int64)
        int32 = rng.random() < 0.3
        raw = encode(
            ids.astype(np.int32) if int32 else ids,
            ids_dtype=pb.DTYPE_INT32 if int32 else pb.DTYPE_INT64,
            output_dtype=output,
        )
        want = rows[ids]
    method = rng.choices(["unary", "chunked", "stream"], weights=[8, 1, 1])[0]
    return Mixed(raw, want.astype(np.float16) if half else want, method)


async def _worker(
    channel: grpc.aio.Channel, seed: int, until: float, rows: np.ndarray, tally: SoakTally
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        job = _mixed(rng, rows)
        started = time.monotonic()
        try:
            if job.method == "unary":
                got = decode_response(await channel.unary_unary(EMBED)(job.raw, timeout=30))
            elif job.method == "chunked":
                chunks = [
                    pb.EmbedChunk.FromString(raw)
                    async for raw in channel.unary_stream(EMBED_CHUNKED)(job.raw, timeout=30)
                ]
                header = chunks[0].header.hidden_states
                dtype = "<f2" if header.dtype == pb.DTYPE_FLOAT16 else "<f4"
                got = np.frombuffer(b"".join(c.data for c in chunks[1:]), dtype).reshape(
                    list(header.shape)
                )
            else:
                answers = [
                    pb.EmbedStreamResponse.FromString(raw)
                    async for raw in channel.stream_stream(EMBED_STREAM)(
                        iter([job.raw, job.raw]), timeout=30
                    )
                ]
                if any(a.WhichOneof("result") != "response" for a in answers) or len(answers) != 2:
                    tally.unexpected.append(
                        f"stream: {answers[0].error if answers else 'no answer'}"
                    )
                    continue
                got = tensor_array(answers[1].response.hidden_states)
        except grpc.aio.AioRpcError as error:
            tally.unexpected.append(f"{job.method} {error.code().name}: {error.details()}")
            continue
        tally.latencies.append(time.monotonic() - started)
        if got.shape != job.want.shape or not np.array_equal(got, job.want):
            tally.unexpected.append(f"{job.method}: wrong answer {got.shape} vs {job.want.shape}")
        else:
            tally.ok[job.method] += 1


async def _load(target: str, seconds: float, seed: int, rows: np.ndarray, tally: SoakTally) -> None:
    channels = [grpc.aio.insecure_channel(target, options=channel_options()) for _ in range(8)]
    until = time.monotonic() + seconds
    try:
        await asyncio.gather(
            *(_worker(channels[i % 8], seed + i, until, rows, tally) for i in range(CONCURRENCY))
        )
    finally:
        for channel in channels:
            await channel.close()


def soak(server: ServerProcess, seconds: float, rows: np.ndarray) -> None:
    assert server.process is not None
    pid = server.process.pid
    warm_up_s = WARM_UP_S
    warm_up = SoakTally()
    asyncio.run(_load(server.target, warm_up_s, 1000, rows, warm_up))
    assert not warm_up.unexpected, warm_up.unexpected[:10]

    samples: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.25):
            samples.append((time.monotonic(), rss(pid)))

    sampler = threading.Thread(target=sample)
    tally = SoakTally()
    started = time.monotonic()
    sampler.start()
    try:
        asyncio.run(_load(server.target, seconds, 0, rows, tally))
    finally:
        stop.set()
        sampler.join(10)
    elapsed = time.monotonic() - started
    first = [value for at, value in samples if at < started + elapsed / 3]
    last = [value for at, value in samples if at >= started + 2 * elapsed / 3]
    # The typical level of each third (the median: a leak moves it, a momentary peak of
    # answers in flight does not).
    growth = (np.median(last) - np.median(first)) / np.median(first)
    total = sum(tally.ok.values())
    print(
        f"\nsoak {seconds:.0f}s (after {warm_up_s:.0f}s of warm-up) at concurrency {CONCURRENCY}: "
        f"{total} requests ok "
        f"({dict(tally.ok)}, {total / elapsed:.0f}/s), {len(tally.unexpected)} unexpected; "
        f"latency {describe(tally.latencies)}; "
        f"RSS median first third {np.median(first) / MiB:.0f} MiB, "
        f"last third {np.median(last) / MiB:.0f} MiB ({growth:+.1%}), "
        f"max {max(v for _, v in samples) / MiB:.0f} MiB"
    )
    assert server.process.poll() is None, server.output[-3000:]
    assert not tally.unexpected, tally.unexpected[:10]
    assert total >= seconds  # it really ran: at least one answer a second (far more in practice)
    assert all(tally.ok[method] > 0 for method in ("unary", "chunked", "stream"))
    assert len(first) >= 5 and len(last) >= 5
    assert growth < MAX_GROWTH, f"RSS grew {growth:.1%} from the first third to the last"


@pytest.mark.slow  # ~90 s; `scripts/test --fast` leaves it out
def test_soak_ci(soak_server: ServerProcess, default_rows: np.ndarray) -> None:
    soak(soak_server, CI_SOAK_S, default_rows)


@pytest.mark.slow
@pytest.mark.skipif(not LONG_SOAK_S, reason="the long soak is opt-in: TOKEMBED_SOAK_S=180")
def test_soak_long(soak_server: ServerProcess, default_rows: np.ndarray) -> None:
    soak(soak_server, LONG_SOAK_S, default_rows)
