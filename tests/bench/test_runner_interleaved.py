"""run_interleaved: calls measured in shuffled turns, each getting its share of time and count;
threaded and asyncio calls side by side."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest

from tokembed.bench.runner import AsyncTurns, run_interleaved, threaded_turns


def test_every_call_gets_every_round_and_its_turns_are_merged() -> None:
    log: list[tuple[str, object]] = []
    entered: list[str] = []

    @contextlib.contextmanager
    def during(name: str) -> Iterator[None]:
        entered.append(name)
        yield

    def recorder(name: str) -> object:
        return lambda request: log.append((name, request))

    runs = run_interleaved(
        {"a": threaded_turns(recorder("a"), [1, 2]), "b": threaded_turns(recorder("b"), [3]),
         "c": threaded_turns(recorder("c"), [4])},
        # Time generous enough never to bind (a loaded machine may take a while to run ten
        # calls): each turn ends on its count.
        duration_s=60, max_requests=40, rounds=4, during=during,
    )  # fmt: skip
    # Each name had 4 turns, each bounded by 40 // 4 = 10 measured calls (plus warm-up).
    assert sorted(entered) == ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    # Warm-ups: up to 2 per turn, as many as there are requests to warm up with.
    assert (runs["a"].warmups, runs["b"].warmups, runs["c"].warmups) == (8, 4, 4)
    for name in "abc":
        assert runs[name].requests == 40
        assert runs[name].latencies_s.size == 40
        assert runs[name].errors == 0
    assert {request for name, request in log if name == "a"} == {1, 2}
    # In turns, not one after the other: the order of the rounds is shuffled and interleaved.
    assert entered[:3] != entered[3:6] or entered[3:6] != entered[6:9]
    assert entered[:3].count("a") == 1


def test_errors_are_counted_and_the_first_kept() -> None:
    def fails_on_7(request: object) -> object:
        if request == 7:
            raise RuntimeError(f"broken {request}")
        return request

    runs = run_interleaved(
        # The warm-up calls (the first two requests) succeed; one measured call in 3 fails.
        {"ok": threaded_turns(lambda r: r, [1]), "bad": threaded_turns(fails_on_7, [1, 1, 7])},
        duration_s=60,  # never binds: each turn ends on its count
        max_requests=9, rounds=3, seed=3,
    )  # fmt: skip
    assert runs["ok"].errors == 0 and runs["ok"].requests == 9
    assert runs["bad"].requests == 6 and runs["bad"].errors == 3
    assert runs["bad"].first_error == "RuntimeError: broken 7"


def test_asyncio_calls_take_turns_on_one_loop_opened_and_closed_once() -> None:
    events: list[str] = []
    loops: set[int] = set()

    async def open_client() -> None:
        loops.add(id(asyncio.get_running_loop()))
        events.append("open")

    async def close_client() -> None:
        events.append("close")

    async def async_call(request: object) -> object:
        loops.add(id(asyncio.get_running_loop()))
        events.append(f"async {request}")
        await asyncio.sleep(0)
        return request

    with AsyncTurns(setup=open_client, teardown=close_client) as loop:
        runs = run_interleaved(
            {"async": loop.turns(async_call, [5], warmup=1),
             "threads": threaded_turns(lambda r: events.append(f"threads {r}"), [6], warmup=1)},
            duration_s=0.5, max_requests=12, rounds=3,
        )  # fmt: skip
        assert events.count("open") == 1 and "close" not in events
    assert events[0] == "open" and events[-1] == "close" and events.count("close") == 1
    # 3 turns of 12 // 3 = 4 measured calls, each after 1 warm-up call.
    for name in ("async", "threads"):
        assert runs[name].requests == 12 and runs[name].errors == 0
        assert runs[name].warmups == 3
    assert events.count("async 5") == 15 and events.count("threads 6") == 15
    assert len(loops) == 1  # every turn ran on the loop the client was opened on
    # Interleaved: some threaded call falls between the first and last asyncio calls.
    first = events.index("async 5")
    last = len(events) - 1 - events[::-1].index("async 5")
    assert "threads 6" in events[first:last]


def test_an_asyncio_turn_outside_its_with_block_is_refused() -> None:
    async def call(request: object) -> object:
        return request

    with AsyncTurns() as loop:
        turn = loop.turns(call, [1])
        assert turn(0.05, 2).requests == 2
    with pytest.raises(AssertionError, match="outside its with block"):
        turn(0.05, 2)
