"""The one owner of a call's deadline: the scheduler, the batcher and the calls' bookkeeping
all ask ``core.deadlines``, so its rules are checked here once."""

from __future__ import annotations

import time

from tokembed.server.core import deadlines
from tokembed.server.core.deadlines import DEADLINE_SLACK_S
from tokembed.server.core.errors import Cancelled, DeadlineExceeded


def test_a_deadline_is_on_the_monotonic_clock() -> None:
    before = time.monotonic()
    deadline = deadlines.after(2.0)
    assert deadline is not None and before + 2.0 <= deadline <= time.monotonic() + 2.0
    assert deadlines.after(None) is None


def test_a_deadline_has_passed_at_its_instant_and_after() -> None:
    assert not deadlines.passed(None, 1e12)
    assert not deadlines.passed(10.0, 9.999)
    assert deadlines.passed(10.0, 10.0)
    assert deadlines.passed(10.0, 11.0)


def test_a_caller_that_left_within_the_slack_of_its_deadline_ran_out_of_time() -> None:
    assert isinstance(deadlines.departure(10.0, 10.0 - DEADLINE_SLACK_S / 2), DeadlineExceeded)
    assert isinstance(deadlines.departure(10.0, 11.0), DeadlineExceeded)
    assert isinstance(deadlines.departure(10.0, 10.0 - DEADLINE_SLACK_S * 2), Cancelled)
    assert isinstance(deadlines.departure(None, 10.0), Cancelled)
    assert deadlines.departure(None, 0.0).reason == "cancelled"
