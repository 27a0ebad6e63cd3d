"""AsyncEmbeddingClient against a real gRPC server on loopback (the scripted fake of
client_fakes.py, standing in for the real server while that one is being written)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from client_fakes import FAKE_NAME, Abort, D, Delay, FakeServer, free_port, rows
from grpc_health.v1 import health_pb2

from tokembed.client import (
    AsyncEmbeddingClient,
    DeadlineExceededError,
    EmbeddingError,
    EmbedResult,
    InvalidInputError,
    OverloadedError,
    RequestTooLargeError,
    UnavailableError,
)

SC = grpc.StatusCode
SENTENCE = [[5, 6, 7, 8, 9, 10, 11, 12]]
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def client_for(server: FakeServer | str, **kwargs: Any) -> AsyncEmbeddingClient:
    target = server if isinstance(server, str) else server.address
    kwargs.setdefault("timeout_s", 10.0)
    return AsyncEmbeddingClient(target, **kwargs)


def test_embed_the_sentence(fake: FakeServer) -> None:
    async def main() -> tuple[np.ndarray, EmbedResult]:
        async with client_for(fake) as client:
            return await client.embed(SENTENCE), await client.embed_result(
                [[1, 2, 3], [4]], "float16", request_id="r"
            )

    hs, ragged = run(main())
    assert hs.shape == (1, 8, D)
    assert np.array_equal(hs, rows(SENTENCE))
    assert not hs.flags.writeable
    assert ragged.hidden_states.dtype == np.float16
    assert ragged.hidden_states.shape == (2, 3, D)
    assert ragged.lengths is not None and ragged.lengths.tolist() == [3, 1]
    assert ragged.request_id == "r"
    assert [c.method for c in fake.service.calls] == ["GetModelInfo", "Embed", "Embed"]


def test_client_made_outside_the_loop_works_inside_it(fake: FakeServer) -> None:
    client = client_for(fake)  # no running loop yet: the channel opens on first use

    async def main() -> np.ndarray:
        try:
            return await client.embed([[1]])
        finally:
            await client.close()

    assert np.array_equal(run(main()), rows([[1]]))


def test_a_new_loop_gets_a_new_channel(fake: FakeServer) -> None:
    client = client_for(fake)
    run(client.embed([[1]]))  # the loop of this asyncio.run ends with it
    assert np.array_equal(run(client.embed([[2]])), rows([[2]]))
    run(client.close())


def test_two_live_loops_cannot_share_a_client(fake: FakeServer) -> None:
    import threading

    client = client_for(fake)
    errors: list[BaseException] = []

    async def main() -> None:
        await client.embed([[1]])

        def other_loop() -> None:
            try:
                asyncio.run(client.embed([[1]]))
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=other_loop)
        thread.start()
        await asyncio.to_thread(thread.join, 10)
        await client.close()

    run(main())
    assert len(errors) == 1
    assert isinstance(errors[0], EmbeddingError)
    assert "one client per event loop" in str(errors[0])


def test_concurrent_calls(fake: FakeServer) -> None:
    async def main() -> list[np.ndarray]:
        async with client_for(fake) as client:
            return await asyncio.gather(*(client.embed([[i, i + 1]]) for i in range(50)))

    for i, hs in enumerate(run(main())):
        assert np.array_equal(hs, rows([[i, i + 1]]))


def test_model_info_and_health(fake: FakeServer) -> None:
    async def main() -> tuple[Any, str, str, str]:
        async with client_for(fake) as client:
            info = await client.model_info()
            serving = await client.health()
            fake.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            return info, serving, await client.health(), await client.health("nope")

    info, serving, not_serving, unknown = run(main())
    assert (info.name, info.d_model) == (FAKE_NAME, D)
    assert (serving, not_serving, unknown) == ("SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")


def test_retries_then_success(fake: FakeServer) -> None:
    fake.service.script += [Abort(SC.UNAVAILABLE, "unavailable")] * 2

    async def main() -> np.ndarray:
        async with client_for(fake, backoff_s=0.01, chunked_threshold_bytes=None) as client:
            return await client.embed(SENTENCE)

    assert np.array_equal(run(main()), rows(SENTENCE))
    assert fake.service.count("Embed") == 3


def test_overload_and_too_large(fake: FakeServer) -> None:
    fake.service.script += [
        Abort(SC.RESOURCE_EXHAUSTED, "overloaded"),
        Abort(SC.RESOURCE_EXHAUSTED, "too_large"),
        Abort(SC.RESOURCE_EXHAUSTED, "overloaded"),
    ]

    async def main() -> None:
        async with client_for(
            fake, retry_on_overload=False, backoff_s=0.01, chunked_threshold_bytes=None
        ) as client:
            with pytest.raises(OverloadedError):
                await client.embed([[1]])
        async with client_for(
            fake, retry_on_overload=True, backoff_s=0.01, chunked_threshold_bytes=None
        ) as client:
            with pytest.raises(RequestTooLargeError):
                await client.embed([[1]])
            assert (await client.embed([[1]])).shape == (1, 1, D)

    run(main())
    assert fake.service.count("Embed") == 4


def test_overall_timeout_spans_the_retries(fake: FakeServer) -> None:
    fake.service.script += [Abort(SC.UNAVAILABLE, "unavailable")] * 1000

    async def main() -> tuple[EmbeddingError, float]:
        async with client_for(
            fake, timeout_s=0.5, retries=1000, backoff_s=0.05, backoff_max_s=0.1,
            chunked_threshold_bytes=None,
        ) as client:  # fmt: skip
            start = time.monotonic()  # the call alone, as in the sync test: not the set-up
            # The last attempt's error: refused, or out of time during it (timing decides).
            with pytest.raises((UnavailableError, DeadlineExceededError)) as info:
                await client.embed([[1]])
            return info.value, time.monotonic() - start

    error, elapsed = run(main())
    assert elapsed < 0.5 + 0.5
    assert 2 <= error.attempts < 1000
    assert f"gave up after {error.attempts} attempts" in str(error)


def test_deadline(fake: FakeServer) -> None:
    fake.service.script.append(Delay(3.0))

    async def main() -> float:
        async with client_for(fake, chunked_threshold_bytes=None) as client:
            start = time.monotonic()
            with pytest.raises(DeadlineExceededError):
                await client.embed([[1]], timeout_s=0.3)
            return time.monotonic() - start

    assert run(main()) < 2.0  # the server would take 3 s


def test_stopped_server() -> None:
    async def main() -> UnavailableError:
        async with client_for(f"127.0.0.1:{free_port()}", retries=1, backoff_s=0.01) as client:
            with pytest.raises(UnavailableError) as info:
                await client.embed([[1]])
            return info.value

    assert run(main()).attempts == 2


def test_chunked(fake: FakeServer) -> None:
    ids = np.arange(300).reshape(3, 100)
    fake.service.script.append(Abort(SC.UNAVAILABLE, "unavailable", after_chunks=3))

    async def main() -> np.ndarray:
        async with client_for(fake, chunked_threshold_bytes=1000, backoff_s=0.01) as client:
            return await client.embed(ids)

    hs = run(main())
    assert np.array_equal(hs, rows(ids))
    assert hs.flags.writeable
    assert fake.service.count("EmbedChunked") == 2


def test_stream_with_async_inputs(fake: FakeServer) -> None:
    async def inputs() -> AsyncIterator[Any]:
        for item in ([[1, 2]], [[-1]], [[0.5]], [[3], [4, 5]]):
            await asyncio.sleep(0)
            yield item

    async def main() -> list[Any]:
        async with client_for(fake) as client:
            return [r async for r in client.embed_stream_results(inputs(), return_exceptions=True)]

    out = run(main())
    assert [type(o) for o in out] == [
        EmbedResult,
        InvalidInputError,
        InvalidInputError,
        EmbedResult,
    ]
    assert np.array_equal(out[0].hidden_states, rows([[1, 2]]))
    assert out[3].hidden_states.shape == (2, 2, D)
    assert fake.service.count("EmbedStream.item") == 3


def test_stream_raises_for_the_failing_item(fake: FakeServer) -> None:
    got: list[np.ndarray] = []

    async def main() -> None:
        async with client_for(fake) as client:
            with pytest.raises(InvalidInputError, match="negative id"):
                async for hs in client.embed_stream([[[1]], [[2]], [[-3]], [[4]]]):
                    got.append(hs)

    run(main())
    assert len(got) == 2


def test_stream_input_failure_reaches_the_caller(fake: FakeServer) -> None:
    async def inputs() -> AsyncIterator[Any]:
        yield [[1]]
        raise KeyError("source broke")

    async def main() -> None:
        async with client_for(fake) as client:
            with pytest.raises(KeyError, match="source broke"):
                async for _ in client.embed_stream(inputs()):
                    pass

    run(main())


def test_round_robin(fake_factory: Callable[..., FakeServer]) -> None:
    servers = [fake_factory() for _ in range(2)]
    target = "ipv4:" + ",".join(s.address for s in servers)

    def spread() -> list[int]:
        return [s.service.count("Embed") for s in servers]

    async def main() -> list[int]:
        async with client_for(target, load_balancing_policy="round_robin") as client:
            # round_robin picks among the connections already made: warm up until all are.
            deadline = time.monotonic() + 10
            while min(spread()) == 0:
                assert time.monotonic() < deadline, spread()
                await client.embed([[1]])
            warm = spread()
            for _ in range(20):
                await client.embed([[1]])
            return warm

    warm = run(main())
    counts = [after - before for after, before in zip(spread(), warm, strict=True)]
    assert sum(counts) == 20
    assert min(counts) >= 5, counts


def test_closed_client(fake: FakeServer) -> None:
    async def main() -> None:
        client = client_for(fake)
        async with client:
            await client.embed([[1]])
        with pytest.raises(EmbeddingError, match="closed"):
            await client.embed([[1]])
        await client.close()

    run(main())
