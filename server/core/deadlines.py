"""A call's deadline: its clock, whether it has passed, and why a call that left early left.

A deadline is a ``time.monotonic()`` instant after which nobody waits for the answer, or
None (no deadline). Every decision about one is made here: the front ends turn the
time their transport says is left into one (``after``), the scheduler and the batcher
ask whether it has passed before a compute (``passed``), and the calls' bookkeeping and
the batcher ask why a call whose caller left did (``departure``).
"""

from __future__ import annotations

import time

from tokembed.server.core.errors import Cancelled, DeadlineExceeded, EmbedError

# A call cancelled less than this before its deadline ran out of time: the caller's own
# timer fires a moment before the server's (its timeout was measured before the request
# travelled), so its cancel can arrive first.
DEADLINE_SLACK_S = 0.05


def after(remaining_s: float | None) -> float | None:
    """The deadline of a call with ``remaining_s`` seconds left now (None: no deadline)."""
    return None if remaining_s is None else time.monotonic() + remaining_s


def passed(deadline: float | None, now: float) -> bool:
    """Whether ``deadline`` has passed at ``now`` (``time.monotonic()``)."""
    return deadline is not None and deadline <= now


def departure(deadline: float | None, left_at: float) -> EmbedError:
    """Why a call whose caller left at ``left_at`` (``time.monotonic()``) left: its
    deadline ran out (within the slack above), or it was cancelled.

    The transport cancels a call in both cases; only the time left tells them apart.
    """
    if deadline is not None and deadline - left_at <= DEADLINE_SLACK_S:
        return DeadlineExceeded("deadline passed")
    return Cancelled("caller left")
