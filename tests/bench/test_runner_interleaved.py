"""run_interleaved: calls measured in shuffled turns, each getting its share of time and count."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tokembed.bench.runner import run_interleaved


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
        {"a": (recorder("a"), [1, 2]), "b": (recorder("b"), [3]), "c": (recorder("c"), [4])},
        duration_s=0.5, max_requests=40, rounds=4, during=during,
    )  # fmt: skip
    # Each name had 4 turns, each bounded by 40 // 4 = 10 measured calls (plus warm-up).
    assert sorted(entered) == ["a"] * 4 + ["b"] * 4 + ["c"] * 4
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
        {"ok": (lambda r: r, [1]), "bad": (fails_on_7, [1, 1, 7])}, duration_s=0.2,
        max_requests=9, rounds=3, seed=3,
    )  # fmt: skip
    assert runs["ok"].errors == 0 and runs["ok"].requests == 9
    assert runs["bad"].requests == 6 and runs["bad"].errors == 3
    assert runs["bad"].first_error == "RuntimeError: broken 7"
