"""``Policy``: the one decision of where a compute runs, and where a batched answer is framed.

Proved here, for every combination of the inputs (does the backend batch; is its batcher
idle; tokens at or over ``inline_max_tokens``; output bytes at or over
``inline_max_bytes``):
- a compute runs inline exactly when its tokens are at most ``inline_max_tokens`` *and*
  its answer is strictly under ``inline_max_bytes`` (``runs_inline``, asked of one
  request and of a batch alike);
- a backend that does not batch runs a request inline by that rule, else off the loop,
  whether or not a batcher is idle (it has none);
- a backend that batches runs a request inline by that rule only while its batcher is
  idle (a lone small request never waits), and otherwise puts it in the batch, whatever
  its size: never off the loop on its own;
- a batched answer is framed inline exactly when it is strictly under
  ``inline_max_bytes``, whatever the token count or the batching;
- the default byte bound is ``INLINE_MAX_BYTES`` (1 MiB).

That the scheduler follows these answers (the thread each compute and frame runs on) is
tests/server/test_scheduler.py's.
"""

from __future__ import annotations

import pytest

from tokembed.server.core.policy import INLINE_MAX_BYTES, Placement, Policy

MAX_TOKENS = 256
MAX_BYTES = 1 << 20

# Each size names where it stands against the bounds (tokens, bytes); the two are set
# apart (a real model ties them through D) so each bound is probed alone.
SIZES = {
    "tiny": (8, 8 * 64 * 4),
    "tokens-at-bound": (MAX_TOKENS, 1000),
    "tokens-over-bound": (MAX_TOKENS + 1, 1000),
    "bytes-just-under": (8, MAX_BYTES - 1),
    "bytes-at-bound": (8, MAX_BYTES),
    "bytes-over-bound": (8, MAX_BYTES + 1),
    "tokens-at-bytes-under": (MAX_TOKENS, MAX_BYTES - 1),
    "tokens-at-bytes-at": (MAX_TOKENS, MAX_BYTES),
    "both-over": (MAX_TOKENS + 1, MAX_BYTES + 1),
}
# Whether a compute of each size runs on the event loop.
INLINE = {
    "tiny": True,
    "tokens-at-bound": True,  # "at most" inline_max_tokens
    "tokens-over-bound": False,
    "bytes-just-under": True,
    "bytes-at-bound": False,  # strictly under inline_max_bytes
    "bytes-over-bound": False,
    "tokens-at-bytes-under": True,
    "tokens-at-bytes-at": False,
    "both-over": False,
}


def policy(*, batches: bool) -> Policy:
    return Policy(batches=batches, inline_max_tokens=MAX_TOKENS, inline_max_bytes=MAX_BYTES)


@pytest.mark.parametrize("size", list(SIZES))
def test_a_compute_runs_inline_only_under_both_bounds(size: str) -> None:
    for batches in (False, True):
        assert policy(batches=batches).runs_inline(*SIZES[size]) is INLINE[size], batches


@pytest.mark.parametrize("batcher_idle", [True, False], ids=["idle", "busy"])
@pytest.mark.parametrize("size", list(SIZES))
def test_a_backend_that_does_not_batch_runs_small_requests_inline_and_others_off_loop(
    size: str, batcher_idle: bool
) -> None:
    tokens, output_bytes = SIZES[size]
    placed = policy(batches=False).place(tokens, output_bytes, batcher_idle=batcher_idle)
    assert placed is (Placement.INLINE if INLINE[size] else Placement.OFF_LOOP)


@pytest.mark.parametrize("size", list(SIZES))
def test_a_backend_that_batches_runs_a_small_request_inline_only_beside_an_idle_batcher(
    size: str,
) -> None:
    tokens, output_bytes = SIZES[size]
    batching = policy(batches=True)
    # Idle: a small request is a batch of one computed at once; a larger one queues
    # (where it goes at once too, the batcher being idle), never off the loop alone.
    idle = batching.place(tokens, output_bytes, batcher_idle=True)
    assert idle is (Placement.INLINE if INLINE[size] else Placement.BATCH)
    # Busy: every request joins the batch, whatever its size.
    assert batching.place(tokens, output_bytes, batcher_idle=False) is Placement.BATCH


def test_no_inline_tokens_means_no_compute_on_the_loop() -> None:
    # inline_compute_max_tokens=0 is the documented "always off-loop" setting.
    table = Policy(batches=False, inline_max_tokens=0)
    assert table.place(1, 256, batcher_idle=True) is Placement.OFF_LOOP
    batching = Policy(batches=True, inline_max_tokens=0)
    assert batching.place(1, 256, batcher_idle=True) is Placement.BATCH
    assert not batching.runs_inline(1, 256)  # a batch of one token leaves the loop too


def test_no_inline_bytes_means_no_compute_and_no_frame_on_the_loop() -> None:
    batching = Policy(batches=True, inline_max_tokens=MAX_TOKENS, inline_max_bytes=0)
    assert batching.place(1, 0, batcher_idle=True) is Placement.BATCH
    assert not batching.runs_inline(1, 0)
    assert not batching.frames_inline(0)


@pytest.mark.parametrize("batches", [False, True], ids=["table", "batched"])
@pytest.mark.parametrize(
    ("output_bytes", "inline"),
    [(0, True), (1, True), (MAX_BYTES - 1, True), (MAX_BYTES, False), (MAX_BYTES + 1, False)],
)
def test_an_answer_is_framed_inline_only_under_the_byte_bound(
    batches: bool, output_bytes: int, inline: bool
) -> None:
    # The token bound plays no part in where an answer is framed: 0 tokens inline here.
    bound = Policy(batches=batches, inline_max_tokens=0, inline_max_bytes=MAX_BYTES)
    assert bound.frames_inline(output_bytes) is inline


def test_the_default_byte_bound_is_one_mebibyte() -> None:
    table = Policy(batches=False, inline_max_tokens=MAX_TOKENS)
    assert table.inline_max_bytes == INLINE_MAX_BYTES == 1 << 20
    assert table.place(8, INLINE_MAX_BYTES - 1, batcher_idle=True) is Placement.INLINE
    assert table.place(8, INLINE_MAX_BYTES, batcher_idle=True) is Placement.OFF_LOOP
    assert table.frames_inline(INLINE_MAX_BYTES - 1)
    assert not table.frames_inline(INLINE_MAX_BYTES)
