"""A batch observer for tests of the service: it remembers what it is told."""

from __future__ import annotations


class BatchRecorder:
    """Every batch reported, as (requests, tokens, compute_s); nothing may be dropped."""

    def __init__(self) -> None:
        self.done: list[tuple[int, int, float]] = []

    def batch_done(self, requests: int, tokens: int, compute_s: float) -> None:
        self.done.append((requests, tokens, compute_s))

    def dropped(self, reason: str) -> None:
        raise AssertionError(f"nothing is dropped here ({reason})")
