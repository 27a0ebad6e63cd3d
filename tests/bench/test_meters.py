"""ServerMeter: the CPU seconds and peak RSS of another process, over a window."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from tokembed.bench.meters import ServerMeter

MiB = 1 << 20
# The child writes this many bytes (every page touched) and spends this much CPU when told.
ALLOCATED = 64 * MiB
BUSY_S = 0.3

_CHILD = f"""
import sys, time
sys.stdout.write("idle\\n"); sys.stdout.flush()
sys.stdin.readline()
held = b"\\x01" * {ALLOCATED}
started = time.process_time()
while time.process_time() - started < {BUSY_S}:
    pass
sys.stdout.write("done\\n"); sys.stdout.flush()
sys.stdin.readline()
"""


@pytest.fixture
def child() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "idle\n"
        yield proc
    finally:
        proc.kill()
        proc.communicate(timeout=30)  # waits, and closes the pipes


def test_the_meter_sees_what_the_process_spends_in_its_window(
    child: subprocess.Popen[str],
) -> None:
    assert child.stdin is not None and child.stdout is not None
    with ServerMeter(child.pid) as meter:
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"
    # CPU counted from the window's start (not the interpreter's start-up), all of the
    # busy loop's; the RSS peak holds the bytes written (sampled while they were held).
    assert BUSY_S * 0.9 <= meter.cpu_s < BUSY_S + 5.0
    assert meter.peak_rss >= ALLOCATED


def test_no_process_measures_nothing() -> None:
    with ServerMeter(None) as meter:
        pass
    assert meter.peak_rss == 0
    assert meter.cpu_s != meter.cpu_s  # NaN: nothing was measured
