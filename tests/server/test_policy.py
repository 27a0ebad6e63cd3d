"""``Policy``: the one decision of where a look-up runs, and where a batched answer is encoded.

Proved here, for every combination of the three inputs (does the backend batch; tokens
at or over ``inline_max_tokens``; output bytes at or over ``inline_max_bytes``):
- a backend that batches puts every request in the batch, whatever its size;
- otherwise a request runs inline exactly when its tokens are at most
  ``inline_max_tokens`` *and* its answer is strictly under ``inline_max_bytes``, and
  off-loop as soon as either bound is reached;
- a batch is looked up inline up to ``batch_inline_max_tokens(row_bytes)`` tokens, and
  that bound is ``runs_inline``'s two bounds for rows of that size: the token bound for
  small rows, the byte bound for large ones;
- a batched answer is encoded inline exactly when it is strictly under
  ``inline_max_bytes``, whatever the token count or the batching;
- the default byte bound is ``INLINE_MAX_BYTES`` (1 MiB).
"""

from __future__ import annotations

import numpy as np
import pytest

from tokembed.server.core.policy import INLINE_MAX_BYTES, Placement, Policy
from tokembed.server.core.types import PADDED, Job, TokenIds

MAX_TOKENS = 256
MAX_BYTES = 1 << 20


def job(tokens: int, output_bytes: int) -> Job:
    """A validated request of ``tokens`` ids and an answer of ``output_bytes``: the two
    are set apart (a real model ties them through D) so each bound is probed alone."""
    ids = TokenIds(np.zeros(tokens, dtype="<i8").tobytes(), np.dtype("<i8"), tokens)
    return Job(
        ids=ids,
        batch=1,
        seq_len=tokens,
        lengths=None,
        output_dtype=np.dtype("<f4"),
        layout=PADDED,
        output_bytes=output_bytes,
    )


# Each size names where it stands against the bounds (tokens, bytes).
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
# Where a table (a backend that does not batch) runs each size.
ALONE = {
    "tiny": Placement.INLINE,
    "tokens-at-bound": Placement.INLINE,  # "at most" inline_max_tokens
    "tokens-over-bound": Placement.OFF_LOOP,
    "bytes-just-under": Placement.INLINE,
    "bytes-at-bound": Placement.OFF_LOOP,  # strictly under inline_max_bytes
    "bytes-over-bound": Placement.OFF_LOOP,
    "tokens-at-bytes-under": Placement.INLINE,
    "tokens-at-bytes-at": Placement.OFF_LOOP,
    "both-over": Placement.OFF_LOOP,
}


@pytest.mark.parametrize("size", list(SIZES))
def test_a_backend_that_does_not_batch_runs_small_requests_inline_and_others_off_loop(
    size: str,
) -> None:
    policy = Policy(batches=False, inline_max_tokens=MAX_TOKENS, inline_max_bytes=MAX_BYTES)
    tokens, output_bytes = SIZES[size]
    assert policy.place(job(tokens, output_bytes)) is ALONE[size]
    # place() and runs_inline() are one rule, not two that could drift apart.
    assert policy.runs_inline(tokens, output_bytes) is (ALONE[size] is Placement.INLINE)


@pytest.mark.parametrize("size", list(SIZES))
def test_a_backend_that_batches_puts_every_request_in_the_batch(size: str) -> None:
    policy = Policy(batches=True, inline_max_tokens=MAX_TOKENS, inline_max_bytes=MAX_BYTES)
    assert policy.place(job(*SIZES[size])) is Placement.BATCH


def test_no_inline_tokens_means_every_table_look_up_is_off_loop() -> None:
    # inline_compute_max_tokens=0 is the documented "always off-loop" setting.
    policy = Policy(batches=False, inline_max_tokens=0)
    assert policy.place(job(1, 256)) is Placement.OFF_LOOP
    assert Policy(batches=True, inline_max_tokens=0).place(job(1, 256)) is Placement.BATCH


@pytest.mark.parametrize(
    ("row_bytes", "bound"),
    [
        (64 * 4, MAX_TOKENS),  # D=64: 256 tokens are 64 KiB, the token bound rules
        (1024 * 4, 255),  # D=1024: 256 tokens would be 1 MiB exactly, not under it
        (4096 * 4, 63),  # D=4096
        (MAX_BYTES, 0),  # one row already reaches the bound
    ],
)
def test_a_batch_s_inline_bound_is_runs_inline_for_its_rows(row_bytes: int, bound: int) -> None:
    policy = Policy(batches=True, inline_max_tokens=MAX_TOKENS, inline_max_bytes=MAX_BYTES)
    assert policy.batch_inline_max_tokens(row_bytes) == bound
    # One rule: a batch of n tokens runs inline exactly when a look-up of n rows would.
    for tokens in range(1, MAX_TOKENS + 2):
        inline = tokens <= policy.batch_inline_max_tokens(row_bytes)
        assert inline is policy.runs_inline(tokens, tokens * row_bytes), tokens


def test_no_inline_bytes_means_no_batch_is_looked_up_inline() -> None:
    policy = Policy(batches=True, inline_max_tokens=MAX_TOKENS, inline_max_bytes=0)
    assert policy.batch_inline_max_tokens(256) < 1


@pytest.mark.parametrize("batches", [False, True], ids=["table", "batched"])
@pytest.mark.parametrize(
    ("output_bytes", "inline"),
    [(0, True), (1, True), (MAX_BYTES - 1, True), (MAX_BYTES, False), (MAX_BYTES + 1, False)],
)
def test_an_answer_is_encoded_inline_only_under_the_byte_bound(
    batches: bool, output_bytes: int, inline: bool
) -> None:
    # The token bound plays no part in where an answer is encoded: 0 tokens inline here.
    policy = Policy(batches=batches, inline_max_tokens=0, inline_max_bytes=MAX_BYTES)
    assert policy.encodes_inline(output_bytes) is inline


def test_the_default_byte_bound_is_one_mebibyte() -> None:
    policy = Policy(batches=False, inline_max_tokens=MAX_TOKENS)
    assert policy.inline_max_bytes == INLINE_MAX_BYTES == 1 << 20
    assert policy.place(job(8, INLINE_MAX_BYTES - 1)) is Placement.INLINE
    assert policy.place(job(8, INLINE_MAX_BYTES)) is Placement.OFF_LOOP
    assert policy.encodes_inline(INLINE_MAX_BYTES - 1)
    assert not policy.encodes_inline(INLINE_MAX_BYTES)
