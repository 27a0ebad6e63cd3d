"""AsyncEmbeddingClient against the real server, answers checked by value against the
reference rows (retries, backoff and replies that break the protocol, which need failures
on cue: test_client_scripted.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from client_support import (
    SENTENCE,
    SMALL_NAME,
    HeldServer,
    LoadingServer,
    async_client_for,
    rejections,
    requests_of,
)

from tokembed.client import (
    DeadlineExceededError,
    EmbeddingError,
    EmbedResult,
    InvalidInputError,
    ModelInfo,
    OverloadedError,
    RequestTooLargeError,
    UnavailableError,
)

from support.fixtures import SMALL_D, SMALL_PAD, SMALL_V
from support.models import padded
from support.ports import free_port
from support.server import ServerThread, wait_for, wait_for_async

SC = grpc.StatusCode
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


def test_embed_the_sentence(real_server: ServerThread, small_rows: np.ndarray) -> None:
    seqs = [[1, 2, 3], [4]]

    async def main() -> tuple[np.ndarray, EmbedResult]:
        async with async_client_for(real_server) as client:
            return await client.embed(SENTENCE), await client.embed_result(
                seqs, "float16", request_id="r"
            )

    hs, ragged = run(main())
    assert hs.shape == (1, 8, SMALL_D)
    np.testing.assert_array_equal(hs, small_rows[SENTENCE])
    assert not hs.flags.writeable
    assert ragged.hidden_states.dtype == np.float16
    want = padded(small_rows, seqs, small_rows[SMALL_PAD]).astype(np.float16)
    np.testing.assert_array_equal(ragged.hidden_states, want)
    assert ragged.lengths is not None and ragged.lengths.tolist() == [3, 1]
    assert (ragged.request_id, ragged.model_name) == ("r", SMALL_NAME)
    assert requests_of(real_server, "GetModelInfo") == 0  # D is learnt from the first answer
    assert requests_of(real_server, "Embed") == 2


def test_client_made_outside_the_loop_works_inside_it(
    real_server: ServerThread, small_rows: np.ndarray
) -> None:
    client = async_client_for(real_server)  # no running loop yet: the channel opens on first use

    async def main() -> np.ndarray:
        try:
            return await client.embed([[1]])
        finally:
            await client.close()

    np.testing.assert_array_equal(run(main()), small_rows[[[1]]])


def test_a_new_loop_gets_a_new_channel(real_server: ServerThread, small_rows: np.ndarray) -> None:
    client = async_client_for(real_server)
    np.testing.assert_array_equal(run(client.embed([[1]])), small_rows[[[1]]])  # loop 1 ends
    np.testing.assert_array_equal(run(client.embed([[2]])), small_rows[[[2]]])
    run(client.close())


def test_two_live_loops_cannot_share_a_client(real_server: ServerThread) -> None:
    client = async_client_for(real_server)
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
        await asyncio.to_thread(thread.join, 30)
        await client.close()

    run(main())
    assert len(errors) == 1
    assert isinstance(errors[0], EmbeddingError)
    assert "one client per event loop" in str(errors[0])
    assert requests_of(real_server, "Embed") == 1


def test_concurrent_calls(real_server: ServerThread, small_rows: np.ndarray) -> None:
    async def main() -> list[np.ndarray]:
        async with async_client_for(real_server) as client:
            return await asyncio.gather(*(client.embed([[i, i + 1]]) for i in range(50)))

    for i, hs in enumerate(run(main())):
        np.testing.assert_array_equal(hs, small_rows[[[i, i + 1]]])


def test_model_info_and_health(loading: LoadingServer) -> None:
    async def main() -> tuple[str, ModelInfo, str, str]:
        async with async_client_for(loading.server) as client:
            loading_status = await client.health()
            await asyncio.to_thread(loading.finish_loading)
            info = await client.model_info()
            return loading_status, info, await client.health(), await client.health("nope")

    loading_status, info, serving, unknown = run(main())
    assert (loading_status, serving, unknown) == ("NOT_SERVING", "SERVING", "SERVICE_UNKNOWN")
    assert (info.name, info.vocab_size, info.d_model) == (SMALL_NAME, SMALL_V, SMALL_D)


def test_overload_is_retried_only_when_asked_and_too_large_never(
    held: HeldServer, small_rows: np.ndarray
) -> None:
    held.fill_queue()
    ids = [[1, 2, 3]]  # 8 queued + 3 > 10: refused while the queue is held

    async def main() -> np.ndarray:
        async with async_client_for(
            held.server, backoff_s=0.01, chunked_threshold_bytes=None
        ) as client:
            with pytest.raises(OverloadedError) as overloaded:
                await client.embed(ids)
            assert overloaded.value.attempts == 1
        async with async_client_for(
            held.server, retries=1000, backoff_s=0.01, backoff_max_s=0.05, retry_on_overload=True,
            chunked_threshold_bytes=None,
        ) as client:  # fmt: skip
            with pytest.raises(RequestTooLargeError) as too_large:
                await client.embed([list(range(65))])  # over the held server's 64 per request
            assert (too_large.value.reason, too_large.value.attempts) == ("too_large", 1)
            call = asyncio.ensure_future(client.embed(ids))
            # Refused, and retried: a second refusal of this call's.
            assert await wait_for_async(lambda: rejections(held.server, "overloaded") >= 3, 30)
            await asyncio.to_thread(held.release)
            return await call

    np.testing.assert_array_equal(run(main()), small_rows[ids])
    assert rejections(held.server, "too_large") == 1


def test_a_held_answer_hits_the_deadline(held: HeldServer) -> None:
    # The look-up waits at the gate, which stays shut: only the deadline can end the call.
    async def main() -> DeadlineExceededError:
        async with async_client_for(held.server, chunked_threshold_bytes=None) as client:
            with pytest.raises(DeadlineExceededError) as info:
                await client.embed([[1]], timeout_s=0.3)
            return info.value

    error = run(main())
    assert (error.code, error.attempts) == (SC.DEADLINE_EXCEEDED, 1)


def test_a_server_that_is_not_there() -> None:
    async def main() -> UnavailableError:
        async with async_client_for(
            f"127.0.0.1:{free_port()}", retries=1, backoff_s=0.01
        ) as client:
            with pytest.raises(UnavailableError) as info:
                await client.embed([[1]])
            return info.value

    assert run(main()).attempts == 2


def test_chunked(
    start_server: Callable[..., ServerThread], small_model_dir: Path, small_rows: np.ndarray
) -> None:
    server = start_server(small_model_dir, stream_chunk_bytes=4096)
    ids = np.arange(300).reshape(3, 100)  # 300 * 64 * 4 = 76800 bytes: 19 chunks

    async def main() -> tuple[np.ndarray, EmbedResult]:
        async with async_client_for(server, chunked_threshold_bytes=10_000) as client:
            first = await client.embed(ids)  # D not known yet: unary, and learnt
            return first, await client.embed(ids), await client.embed_result(ids, "float16")

    first, hs, half = run(main())
    np.testing.assert_array_equal(first, small_rows[ids])
    assert not first.flags.writeable  # a view of the unary answer
    np.testing.assert_array_equal(hs, small_rows[ids])
    assert hs.flags.writeable  # assembled in the client's own buffer
    np.testing.assert_array_equal(half.hidden_states, small_rows[ids].astype(np.float16))
    assert half.model_name == SMALL_NAME
    assert wait_for(lambda: requests_of(server, "EmbedChunked") == 2, 10)
    assert requests_of(server, "Embed") == 1


def test_stream_with_async_inputs(real_server: ServerThread, small_rows: np.ndarray) -> None:
    async def inputs() -> AsyncIterator[Any]:
        for item in ([[1, 2]], [[SMALL_V]], [[0.5]], [[3], [4, 5]]):
            await asyncio.sleep(0)
            yield item

    async def main() -> list[Any]:
        async with async_client_for(real_server) as client:
            return [r async for r in client.embed_stream_results(inputs(), return_exceptions=True)]

    out = run(main())
    assert [type(o) for o in out] == [
        EmbedResult,
        InvalidInputError,
        InvalidInputError,
        EmbedResult,
    ]
    np.testing.assert_array_equal(out[0].hidden_states, small_rows[[[1, 2]]])
    assert (out[1].reason, out[1].code) == ("invalid_input", SC.INVALID_ARGUMENT)  # the server's
    assert "float" in str(out[2])  # the client's own
    want = padded(small_rows, [[3], [4, 5]], small_rows[SMALL_PAD])
    np.testing.assert_array_equal(out[3].hidden_states, want)
    assert requests_of(real_server, "EmbedStream") == 3


def test_stream_raises_for_the_failing_item(
    real_server: ServerThread, small_rows: np.ndarray
) -> None:
    got: list[np.ndarray] = []

    async def main() -> InvalidInputError:
        async with async_client_for(real_server) as client:
            with pytest.raises(InvalidInputError, match="outside the vocabulary") as info:
                async for hs in client.embed_stream([[[1]], [[2]], [[SMALL_V + 3]], [[4]]]):
                    got.append(hs)
            return info.value

    assert run(main()).reason == "invalid_input"
    np.testing.assert_array_equal(np.concatenate(got), small_rows[[[1], [2]]])


def test_stream_tells_overloaded_from_too_large_by_reason(
    held: HeldServer, small_rows: np.ndarray
) -> None:
    held.fill_queue()
    inputs = [[[1, 2, 3]], [list(range(65))], [[4]]]  # overloaded, too large, then queued

    async def main() -> list[Any]:
        async with async_client_for(held.server) as client:
            results = client.embed_stream_results(inputs, return_exceptions=True)
            out = [await anext(results), await anext(results)]
            await asyncio.to_thread(held.release)  # the third waits at the gate until now
            return out + [r async for r in results]

    overloaded, too_large, last = run(main())
    assert type(overloaded) is OverloadedError and overloaded.reason == "overloaded"
    assert type(too_large) is RequestTooLargeError and too_large.reason == "too_large"
    assert overloaded.code == too_large.code == SC.RESOURCE_EXHAUSTED
    np.testing.assert_array_equal(last.hidden_states, small_rows[[[4]]])


def test_stream_input_failure_reaches_the_caller(real_server: ServerThread) -> None:
    async def inputs() -> AsyncIterator[Any]:
        yield [[1]]
        raise KeyError("source broke")

    async def main() -> None:
        async with async_client_for(real_server) as client:
            with pytest.raises(KeyError, match="source broke"):
                async for _ in client.embed_stream(inputs()):
                    pass

    run(main())


def test_round_robin(
    start_server: Callable[..., ServerThread], small_model_dir: Path, small_rows: np.ndarray
) -> None:
    servers = [start_server(small_model_dir) for _ in range(2)]
    target = "ipv4:" + ",".join(s.target for s in servers)

    def spread() -> list[int]:
        return [requests_of(s, "Embed") for s in servers]

    async def main() -> list[int]:
        async with async_client_for(target, load_balancing_policy="round_robin") as client:
            # round_robin picks among the connections already made: warm up until all are
            # (the bound only keeps a broken client from looping for ever).
            give_up_at = time.monotonic() + 60
            while min(spread()) == 0:
                assert time.monotonic() < give_up_at, spread()
                await client.embed([[1]])
            warm = spread()
            for i in range(20):
                np.testing.assert_array_equal(await client.embed([[i]]), small_rows[[[i]]])
            return warm

    warm = run(main())
    counts = [after - before for after, before in zip(spread(), warm, strict=True)]
    assert sum(counts) == 20
    assert min(counts) >= 5, counts


def test_closed_client(real_server: ServerThread) -> None:
    async def main() -> None:
        client = async_client_for(real_server)
        async with client:
            await client.embed([[1]])
        with pytest.raises(EmbeddingError, match="closed"):
            await client.embed([[1]])
        await client.close()

    run(main())
    assert requests_of(real_server, "Embed") == 1
