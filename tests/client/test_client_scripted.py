"""Both clients against the scripted fake (client_fakes.py), for what the real server cannot
produce on cue: a failure on the n-th attempt (retries, backoff, the overall deadline, a
chunked answer broken mid-way) and replies that break the protocol.

Timing is judged by what holds however slow the machine: the waits the client chose (its
log line per retry), the arrival and deadline left of each attempt as the fake recorded
them, and relations between those, never a fixed margin a busy core can overrun.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from client_fakes import Abort, Call, FakeServer, Reply, rows

from tokembed.client import (
    AsyncEmbeddingClient,
    DeadlineExceededError,
    EmbeddingClient,
    EmbeddingError,
    ServerError,
    UnavailableError,
)
from tokembed.v1 import embedding_pb2 as pb

SC = grpc.StatusCode
T = TypeVar("T")
SENTENCE = [[5, 6, 7, 8, 9, 10, 11, 12]]
UNAVAILABLE = Abort(SC.UNAVAILABLE, "unavailable", "draining")
# gRPC sends a call's timeout rounded up to its wire unit: what a deadline left may exceed
# the exact figure by (a fixed encoding step, not a matter of load).
WIRE_ROUNDING_S = 0.01


def client_for(server: FakeServer, **kwargs: Any) -> EmbeddingClient:
    kwargs.setdefault("timeout_s", 30.0)
    return EmbeddingClient(server.address, **kwargs)


def async_client_for(server: FakeServer, **kwargs: Any) -> AsyncEmbeddingClient:
    kwargs.setdefault("timeout_s", 30.0)
    return AsyncEmbeddingClient(server.address, **kwargs)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


def chosen_waits(caplog: pytest.LogCaptureFixture) -> list[float]:
    """The wait before each retry, as the client logged it ("retry n in 0.123 s")."""
    messages = [r.getMessage() for r in caplog.records]
    return [float(m.rsplit(" in ", 1)[1].split()[0]) for m in messages if "; retry " in m]


def arrivals(calls: list[Call], method: str = "Embed") -> list[float]:
    return [c.at for c in calls if c.method == method]


# ---------------------------------------------------------------- retries and backoff


def test_unavailable_twice_then_success(fake: FakeServer) -> None:
    fake.service.script += [UNAVAILABLE] * 2
    with client_for(fake, retries=2, backoff_s=0.01, chunked_threshold_bytes=None) as client:
        hs = client.embed(SENTENCE)
    np.testing.assert_array_equal(hs, rows(SENTENCE))
    assert fake.service.count("Embed") == 3


def test_retries_are_bounded(fake: FakeServer) -> None:
    fake.service.script += [UNAVAILABLE] * 5
    with (
        client_for(fake, retries=2, backoff_s=0.01, chunked_threshold_bytes=None) as client,
        pytest.raises(UnavailableError, match="gave up after 3 attempts") as info,
    ):
        client.embed([[1]])
    assert (info.value.attempts, info.value.reason) == (3, "unavailable")
    assert "draining" in str(info.value)
    assert fake.service.count("Embed") == 3


def test_backoff_grows_exponentially_with_jitter(
    fake: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    fake.service.script += [UNAVAILABLE] * 3
    with (
        caplog.at_level(logging.INFO, logger="tokembed.client"),
        client_for(
            fake, retries=3, backoff_s=0.1, backoff_max_s=10, chunked_threshold_bytes=None
        ) as client,
    ):
        client.embed([[1]])
    waits = chosen_waits(caplog)
    assert len(waits) == 3, caplog.text
    # The n-th wait is drawn from [d/2, d], d = 0.1 * 2^n (the log rounds to 1 ms).
    for n, wait in enumerate(waits):
        assert 0.1 * 2**n / 2 - 0.0005 <= wait <= 0.1 * 2**n + 0.0005, waits
    # ... and each was slept: the next attempt came no sooner (later, on a busy machine).
    gaps = np.diff(arrivals(fake.service.calls))
    assert all(gap >= wait - 0.001 for gap, wait in zip(gaps, waits, strict=True)), (gaps, waits)


def test_backoff_is_capped(fake: FakeServer, caplog: pytest.LogCaptureFixture) -> None:
    fake.service.script += [UNAVAILABLE] * 4
    with (
        caplog.at_level(logging.INFO, logger="tokembed.client"),
        client_for(
            fake, retries=4, backoff_s=0.05, backoff_max_s=0.06, chunked_threshold_bytes=None
        ) as client,
    ):
        client.embed([[1]])
    # Uncapped, the 4th would be drawn from [0.2, 0.4]; capped, each is drawn from
    # [0.03, 0.06] once 0.05·2^n > 0.06.
    waits = chosen_waits(caplog)
    assert len(waits) == 4, caplog.text
    assert 0.025 <= waits[0] <= 0.05 and all(0.03 <= d <= 0.06 for d in waits[1:]), waits
    gaps = np.diff(arrivals(fake.service.calls))
    assert all(gap >= wait - 0.001 for gap, wait in zip(gaps, waits, strict=True)), (gaps, waits)


def test_retry_is_logged(fake: FakeServer, caplog: pytest.LogCaptureFixture) -> None:
    fake.service.script.append(UNAVAILABLE)
    with (
        caplog.at_level(logging.INFO, logger="tokembed.client"),
        client_for(fake, backoff_s=0.01, chunked_threshold_bytes=None) as client,
    ):
        client.embed([[1]])
    assert any("Embed failed (UNAVAILABLE" in m and "retry 1" in m for m in caplog.messages)


# ---------------------------------------------------------------- the overall deadline

TIMEOUT_S, BACKOFF_S, BACKOFF_MAX_S = 0.6, 0.05, 0.1


def check_the_deadline_spans_the_retries(
    error: EmbeddingError, elapsed_s: float, calls: list[Call]
) -> None:
    """What a call with TIMEOUT_S, 1000 retries and a server answering UNAVAILABLE for ever
    shows, however slow the machine: only relations that load cannot break (it can only
    make each step later), none of them a margin on the clock."""
    attempts = error.attempts
    assert f"gave up after {attempts} attempts" in str(error)
    # The deadline, not ``retries``, ended it: every retry first sleeps at least
    # BACKOFF_S / 2, and only while the sleep ends before the deadline.
    assert 2 <= attempts <= 1 + TIMEOUT_S / (BACKOFF_S / 2)
    # It gave up only once no time was left for another wait: within BACKOFF_MAX_S of a
    # deadline that began after ``elapsed_s`` did (or at the deadline, out of time).
    assert elapsed_s >= TIMEOUT_S - BACKOFF_MAX_S
    embeds = [c for c in calls if c.method == "Embed"]
    # The last attempt may run out of time before the server sees it.
    assert len(embeds) in (attempts - 1, attempts)
    # Each attempt got what was left of the one deadline, not a fresh TIMEOUT_S: the
    # deadline began before the first attempt arrived (embeds[0].at), and attempt i was
    # sent after attempt i-1 had failed (after embeds[i-1].at), so it had at most
    # embeds[0].at + TIMEOUT_S - embeds[i-1].at left. A fresh timeout breaks this from
    # the third attempt on (each retry waits at least 25 ms).
    bounds = [TIMEOUT_S] + [embeds[0].at + TIMEOUT_S - before.at for before in embeds[:-1]]
    for attempt, bound in zip(embeds, bounds, strict=True):
        assert attempt.time_remaining is not None
        assert attempt.time_remaining <= bound + WIRE_ROUNDING_S, (
            [c.time_remaining for c in embeds],
            bounds,
        )


def test_overall_timeout_spans_the_retries(fake: FakeServer) -> None:
    fake.service.script += [UNAVAILABLE] * 1000
    with client_for(
        fake, timeout_s=TIMEOUT_S, retries=1000, backoff_s=BACKOFF_S, backoff_max_s=BACKOFF_MAX_S,
        chunked_threshold_bytes=None,
    ) as client:  # fmt: skip
        start = time.monotonic()  # the call alone: not the client's set-up
        # The last attempt's error: refused (no time left for another), or out of time
        # during it; which of the two depends on how long each attempt took.
        with pytest.raises((UnavailableError, DeadlineExceededError)) as info:
            client.embed([[1]])
        elapsed = time.monotonic() - start
    check_the_deadline_spans_the_retries(info.value, elapsed, fake.service.calls)


def test_async_overall_timeout_spans_the_retries(fake: FakeServer) -> None:
    fake.service.script += [UNAVAILABLE] * 1000

    async def main() -> tuple[EmbeddingError, float]:
        async with async_client_for(
            fake, timeout_s=TIMEOUT_S, retries=1000, backoff_s=BACKOFF_S,
            backoff_max_s=BACKOFF_MAX_S, chunked_threshold_bytes=None,
        ) as client:  # fmt: skip
            start = time.monotonic()  # the call alone: not the client's set-up
            with pytest.raises((UnavailableError, DeadlineExceededError)) as info:
                await client.embed([[1]])
            return info.value, time.monotonic() - start

    error, elapsed = run(main())
    check_the_deadline_spans_the_retries(error, elapsed, fake.service.calls)


def test_async_retries_then_success(fake: FakeServer) -> None:
    fake.service.script += [UNAVAILABLE] * 2

    async def main() -> np.ndarray:
        async with async_client_for(fake, backoff_s=0.01, chunked_threshold_bytes=None) as client:
            return await client.embed(SENTENCE)

    np.testing.assert_array_equal(run(main()), rows(SENTENCE))
    assert fake.service.count("Embed") == 3


# ---------------------------------------------------------------- chunked answers


def test_chunked_retries_a_stream_broken_midway(fake: FakeServer) -> None:
    fake.service.script.append(Abort(SC.UNAVAILABLE, "unavailable", after_messages=2))
    ids = np.arange(100).reshape(2, 50)  # 3200 bytes: a header and 4 chunks of 1000 or less
    with client_for(fake, chunked_threshold_bytes=0, backoff_s=0.01) as client:
        client.info()  # D known: the call goes chunked (the first one would go unary)
        hs = client.embed(ids)
    np.testing.assert_array_equal(hs, rows(ids))
    assert fake.service.count("EmbedChunked") == 2


def test_async_chunked_retries_a_stream_broken_midway(fake: FakeServer) -> None:
    ids = np.arange(300).reshape(3, 100)
    fake.service.script.append(Abort(SC.UNAVAILABLE, "unavailable", after_messages=3))

    async def main() -> np.ndarray:
        async with async_client_for(fake, chunked_threshold_bytes=0, backoff_s=0.01) as client:
            await client.info()  # D known: the call goes chunked
            return await client.embed(ids)

    hs = run(main())
    np.testing.assert_array_equal(hs, rows(ids))
    assert hs.flags.writeable
    assert fake.service.count("EmbedChunked") == 2


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "aio"])
def test_a_chunked_answer_cut_short_is_refused_not_retried(fake: FakeServer, aio: bool) -> None:
    fake.service.script.append(Reply(lambda chunks: chunks[:-1]))  # the last slice lost
    ids = np.arange(100).reshape(2, 50)  # 3200 bytes: the last slice holds 200

    async def in_a_loop() -> None:
        async with async_client_for(fake, chunked_threshold_bytes=0, retries=3) as client:
            await client.info()  # D known: the call goes chunked
            await client.embed(ids)

    with pytest.raises(ServerError, match="ended after 3000 of 3200 bytes") as info:
        if aio:
            run(in_a_loop())
        else:
            with client_for(fake, chunked_threshold_bytes=0, retries=3) as client:
                client.info()
                client.embed(ids)
    assert (info.value.code, info.value.reason) == (None, "protocol")
    assert fake.service.count("EmbedChunked") == 1


# ---------------------------------------------------------------- replies that break the protocol


def _drop_a_row(answers: list[pb.EmbedResponse]) -> list[pb.EmbedResponse]:
    t = answers[0].hidden_states
    b, s, d = t.shape
    t.shape[:] = [b, s - 1, d]
    t.data = t.data[: b * (s - 1) * d * 4]
    return answers


@pytest.mark.parametrize("method", ["embed", "embed_result"])
def test_wrong_shape_from_server_is_a_protocol_error(fake: FakeServer, method: str) -> None:
    fake.service.script.append(Reply(_drop_a_row))
    with (
        client_for(fake, chunked_threshold_bytes=None, retries=3) as client,
        pytest.raises(ServerError, match=r"answer has shape \(1, 2, 8\) for a request") as info,
    ):
        getattr(client, method)([[1, 2, 3]])
    assert info.value.reason == "protocol"
    assert fake.service.count("Embed") == 1  # a broken answer is not retried


STREAM_FAULTS = {
    # one answer too many: the client cannot know whose it is
    "extra": (lambda answers: [*answers, answers[-1]], "sent more answers than requests"),
    "missing": (lambda answers: answers[:-1], "ended with requests unanswered"),
}


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "aio"])
@pytest.mark.parametrize("fault", list(STREAM_FAULTS))
def test_a_stream_answering_out_of_step_is_a_protocol_error(
    fake: FakeServer, fault: str, aio: bool
) -> None:
    edit, words = STREAM_FAULTS[fault]
    fake.service.script.append(Reply(edit))
    inputs = [[[1]], [[2, 3]], [[4]]]
    got: list[np.ndarray] = []

    async def in_a_loop() -> None:
        async with async_client_for(fake) as client:
            async for hs in client.embed_stream(inputs):
                got.append(hs)

    with pytest.raises(ServerError, match=words) as info:
        if aio:
            run(in_a_loop())
        else:
            with client_for(fake) as client:
                for hs in client.embed_stream(inputs):
                    got.append(hs)
    assert info.value.reason == "protocol"
    # The answers in step came first, each the right one.
    answered = len(inputs) if fault == "extra" else len(inputs) - 1
    assert len(got) == answered
    for ids, hs in zip(inputs, got, strict=False):
        np.testing.assert_array_equal(hs, rows(ids))
