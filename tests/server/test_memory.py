"""Allocator tuning: when ``tokembed serve`` restarts itself for huge-page malloc."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokembed.server import memory

pytestmark = pytest.mark.skipif(
    not memory.is_glibc(), reason="GLIBC_TUNABLES only means something to glibc"
)


@pytest.fixture
def thp_madvise(tmp_path: Path) -> Path:
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    return mode


def test_adds_the_tunable_to_an_environment_without_one(thp_madvise: Path) -> None:
    environ = memory.environ_with_huge_page_malloc({"PATH": "/bin"}, thp_madvise)
    assert environ == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def test_keeps_the_operators_other_tunables(thp_madvise: Path) -> None:
    environ = memory.environ_with_huge_page_malloc(
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, thp_madvise
    )
    assert environ is not None
    assert environ["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


@pytest.mark.parametrize("already", ["glibc.malloc.hugetlb=1", "glibc.malloc.hugetlb=0"])
def test_no_restart_once_the_tunable_is_set_by_us_or_the_operator(
    already: str, thp_madvise: Path
) -> None:
    # Set: the restarted process itself (no loop), or an operator who chose 0.
    environ = {"GLIBC_TUNABLES": f"glibc.mem.tagging=0:{already}"}
    assert memory.environ_with_huge_page_malloc(environ, thp_madvise) is None


def test_no_restart_when_the_kernel_has_huge_pages_off(tmp_path: Path) -> None:
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    assert memory.environ_with_huge_page_malloc({}, never) is None
    assert memory.environ_with_huge_page_malloc({}, tmp_path / "missing") is None


def test_a_restart_that_cannot_happen_goes_on_without_the_tuning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(*args: object) -> None:
        raise OSError(2, "no executable to restart")

    monkeypatch.setattr(memory.os, "execve", refuse)
    memory.restart_with({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})  # returns
    assert "could not restart for huge-page malloc" in caplog.text
