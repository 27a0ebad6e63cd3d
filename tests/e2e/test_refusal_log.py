"""Refusals do not flood the log: per reason, the first one in full (WARNING), then one
line per interval saying how many more there were; each refusal also has its own line at
DEBUG, and the metrics count every one. Through the real server, with a short interval."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import grpc
import pytest

from tokembed.v1 import embedding_pb2 as pb

from support.requests import embed_request, stub_for
from support.server import ServerThread, wait_for

INTERVAL_S = 0.5
CALLS_LOGGER = "tokembed.server.servicer"


def _bad_request(index: int) -> pb.EmbedRequest:
    """Ids out of range (V is 1000): INVALID_ARGUMENT, reason invalid_input."""
    return embed_request([[1000 + index]], request_id=f"bad-{index}")


def _refuse(server: ServerThread, count: int) -> None:
    with stub_for(server.target) as stub:
        for index in range(count):
            with pytest.raises(grpc.RpcError) as caught:
                stub.Embed(_bad_request(index), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _lines(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records
        if r.name == CALLS_LOGGER and r.levelno == level and text in r.getMessage()
    ]  # fmt: skip


def _accounted(caplog: pytest.LogCaptureFixture) -> tuple[int, int, int]:
    """(refusals logged in full, refusals counted in summaries, per-refusal debug lines)."""
    full = len(_lines(caplog, logging.WARNING, "Embed rejected (invalid_input"))
    summed = sum(
        int(line.split(" ", 1)[0])
        for line in _lines(caplog, logging.WARNING, "more rejected (invalid_input)")
    )
    debug = len(_lines(caplog, logging.DEBUG, "Embed rejected (invalid_input"))
    return full, summed, debug


def test_a_flood_of_refusals_logs_the_first_and_then_a_count_per_interval(
    small_model_dir: Path, start_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Counted by invariants, not by timing: however the 30 refusals fall into intervals
    on a busy machine, each is in exactly one full line or one summary, the summaries
    come by themselves once the interval is over, and the rest are debug lines."""
    caplog.set_level(logging.DEBUG, logger=CALLS_LOGGER)
    server: ServerThread = start_server(small_model_dir, log_summary_interval_s=INTERVAL_S)
    _refuse(server, 30)
    # No refusal since: every interval closes on its own timer, with its summary.
    assert wait_for(lambda: sum(_accounted(caplog)[:2]) == 30, 10), _accounted(caplog)
    full, summed, debug = _accounted(caplog)
    assert 1 <= full < 30 and summed == 30 - full and debug == summed
    first = _lines(caplog, logging.WARNING, "Embed rejected (invalid_input")[0]
    assert "request_id='bad-0'" in first and "outside the vocabulary" in first
    assert server.metric("tokembed_rejections_total", {"reason": "invalid_input"}) == 30


def test_a_stop_says_what_was_not_summed_up_yet(
    small_model_dir: Path, start_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=CALLS_LOGGER)
    server: ServerThread = start_server(small_model_dir, log_summary_interval_s=3600)
    _refuse(server, 5)
    assert _lines(caplog, logging.WARNING, "more rejected") == []
    assert len(_lines(caplog, logging.WARNING, "Embed rejected (invalid_input")) == 1
    server.stop()
    (summary,) = _lines(caplog, logging.WARNING, "more rejected")
    assert summary.startswith("4 more rejected (invalid_input) in the last")
