"""``tokembed serve`` restarts itself once for huge-page malloc (server/memory.py):
same pid, same command line, the tunable in its environment, exact answers after."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest

from tokembed.client import EmbeddingClient
from tokembed.server import memory

from support.fixtures import SMALL_D, SMALL_PAD, SMALL_SEED, SMALL_V
from support.models import reference_rows
from support.server import ServerProcess, serve_args

pytestmark = pytest.mark.skipif(
    not memory.is_glibc() or not memory.transparent_huge_pages_usable(),
    reason="needs glibc and transparent huge pages not [never]",
)


def _environment_of(pid: int) -> bytes:
    # Raw: glibc parses GLIBC_TUNABLES in place at start, writing NULs over its colons.
    return Path(f"/proc/{pid}/environ").read_bytes()


def _serve_and_check(server: ServerProcess) -> bytes:
    """Start, answer exactly, stop cleanly; the served process's environment block."""
    server.start()
    try:
        assert server.process is not None
        environment = _environment_of(server.process.pid)  # the pid Popen started
        ids = np.array([[1, 2, 3, SMALL_V - 1]], dtype=np.int64)
        with EmbeddingClient(server.target) as client:
            answer = client.embed(ids)
        expected = reference_rows(SMALL_V, SMALL_D, SMALL_SEED, SMALL_PAD)[ids]
        np.testing.assert_array_equal(answer, expected)
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
    return environment


def test_serve_restarts_itself_with_huge_page_malloc(small_model_dir: Path) -> None:
    server = ServerProcess(
        serve_args(small_model_dir), env={"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}
    )
    environment = _serve_and_check(server)
    assert b"GLIBC_TUNABLES=glibc.malloc.arena_max=4" in environment  # kept
    assert b"glibc.malloc.hugetlb=1" in environment  # added
    assert server.output.count("listening on") == 1  # restarted before it bound anything


def test_serve_stays_as_started_when_huge_pages_are_off(small_model_dir: Path) -> None:
    server = ServerProcess(
        serve_args(small_model_dir, "--malloc-huge-pages", "off"), env={"GLIBC_TUNABLES": ""}
    )
    environment = _serve_and_check(server)
    assert b"hugetlb" not in environment
