"""Skip accounting: a run fails when a test skipped that the allow-list does not name.

Loaded with ``-p support.skips`` (pyproject.toml) and idle unless ``TOKEMBED_EXPECTED_SKIPS``
names an allow-list file (``.ci/run`` sets it to ``tests/expected_skips.txt``). Then, at the
end of the session, the run fails (exit status 1) and says why when

- a test skipped (a ``skip``/``skipif`` mark, ``pytest.skip`` in a fixture or the test, or a
  whole module skipped at collection) that no active entry allows, or
- an entry matches no test of a file this run collected whole (named, or under a folder
  named, on the command line or by testpaths; deselected tests count as collected), or
  names a file that does not exist: the list went stale.

An entry outside the file's sections is always active. An entry under a ``[needs PACKAGE]``
heading is active only when ``TOKEMBED_EXPECTED_SKIPS_WITHOUT`` names that Debian package
(space-separated): ``.ci/run`` sets it, on request, where it cannot install the package.
Each entry is a node id, ``*`` matching any characters (nothing else is special: node ids
hold brackets), then `` # `` and the reason the test may skip; in a section, one test per
entry, no ``*``, so that ``.ci/run`` can count them without Python.

With pytest-xdist the controller sees every test report, and each worker hands it the ids it
collected (``workeroutput``), so ``-n 2`` checks the same as a serial run. An expected
failure (``xfail``) is not a skip.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ALLOW_LIST_ENV = "TOKEMBED_EXPECTED_SKIPS"
SECTIONS_ENV = "TOKEMBED_EXPECTED_SKIPS_WITHOUT"
_WORKER_KEY = "tokembed_collected_ids"
_SECTION = re.compile(r"\[needs ([A-Za-z0-9.+-]+)\]")
_REASON = re.compile(r"\s#\s")


class AllowListError(Exception):
    """The allow-list file cannot be read as one."""


@dataclass(frozen=True)
class Entry:
    pattern: str
    reason: str
    line: int
    section: str | None  # the Debian package whose absence allows the skip; None: always

    @property
    def file(self) -> str:
        return self.pattern.split("::", 1)[0]

    def matches(self, nodeid: str) -> bool:
        return _compile(self.pattern).fullmatch(nodeid) is not None

    def matches_file(self, file: str) -> bool:
        return _compile(self.file).fullmatch(file) is not None


def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in pattern.split("*")))


def parse_allow_list(text: str) -> list[Entry]:
    """The entries of an allow-list file; raises AllowListError naming the bad line."""
    entries: list[Entry] = []
    section: str | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        heading = _SECTION.fullmatch(line)
        if heading:
            section = heading.group(1)
            continue
        if line.startswith("["):
            raise AllowListError(f"line {number}: a section heading is `[needs PACKAGE]`")
        # Node ids may hold spaces and `#` (parameter ids); ` # ` ends one.
        found = _REASON.search(line + " ")
        pattern = line[: found.start()].strip() if found else line
        reason = line[found.end() :].strip() if found else ""
        if not reason:
            raise AllowListError(f"line {number}: `{pattern}` says no reason (` # why`)")
        if "::" not in pattern:
            raise AllowListError(f"line {number}: `{pattern}` is not a test's node id")
        if section is not None and "*" in pattern:
            raise AllowListError(f"line {number}: one test per entry in [needs {section}]")
        entries.append(Entry(pattern, reason, number, section))
    return entries


class SkipAccounting:
    """The hooks, one instance per session (registered only when the check is asked for)."""

    def __init__(self, config: pytest.Config, path: Path, entries: list[Entry]) -> None:
        self.config = config
        self.path = path
        self.entries = entries
        self.sections = frozenset(os.environ.get(SECTIONS_ENV, "").split())
        unknown = self.sections - {e.section for e in entries}
        if unknown:
            raise pytest.UsageError(
                f"{SECTIONS_ENV} names {sorted(unknown)}, which {path} has no section for"
            )
        self.collected: set[str] = set()
        self.skipped: dict[str, str] = {}  # node id -> reason
        self.problems: list[str] = []

    # --- what was collected: here, or in xdist's workers

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.collected.update(item.nodeid for item in items)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.collected.update(item.nodeid for item in session.items)
        if _is_worker(self.config):
            workeroutput: dict[str, Any] = self.config.workeroutput  # type: ignore[attr-defined]
            workeroutput[_WORKER_KEY] = sorted(self.collected)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object) -> None:
        """xdist's controller: a worker is done; take the ids it collected."""
        self.collected.update(getattr(node, "workeroutput", {}).get(_WORKER_KEY, ()))

    # --- what skipped: xdist's controller sees its workers' reports through the same hooks

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._record(report)

    def _record(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skipped.setdefault(report.nodeid, _reason(report))

    # --- the verdict

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if _is_worker(self.config):
            return  # a worker saw only its share; the controller judges
        active = [e for e in self.entries if e.section is None or e.section in self.sections]
        unexpected = {
            nodeid: reason
            for nodeid, reason in self.skipped.items()
            if not any(e.matches(nodeid) for e in active)
        }
        judged = self._fully_collected_files()
        stale = [e for e in self.entries if self._is_stale(e, judged)]
        if unexpected:
            self.problems.append(
                f"{_count(len(unexpected), 'test')} skipped that {self.path.name} does not "
                "allow (install what they need, or allow-list them with the reason):"
            )
            self.problems += [f"  {nodeid}: {why}" for nodeid, why in sorted(unexpected.items())]
        if stale:
            self.problems.append(
                f"{_count(len(stale), 'entry', 'entries')} of {self.path.name} "
                f"{'matches' if len(stale) == 1 else 'match'} no collected test (renamed or "
                "removed? fix the list):"
            )
            self.problems += [f"  line {e.line}: {e.pattern}" for e in stale]
        if self.problems and session.exitstatus in (
            pytest.ExitCode.OK,
            pytest.ExitCode.NO_TESTS_COLLECTED,
        ):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _fully_collected_files(self) -> set[str]:
        """The files of collected tests that this run collected whole: named, or under a
        folder named, on the command line (or by testpaths), not through a node id."""
        roots = [
            (self.config.invocation_params.dir / arg).resolve()
            for arg in self.config.args
            if "::" not in arg
        ]
        files = {nodeid.split("::", 1)[0] for nodeid in self.collected}
        return {
            file
            for file in files
            if any((self.config.rootpath / file).resolve().is_relative_to(r) for r in roots)
        }

    def _is_stale(self, entry: Entry, judged: set[str]) -> bool:
        if any(entry.matches(nodeid) for nodeid in self.collected):
            return False
        if "*" not in entry.file and not (self.config.rootpath / entry.file).is_file():
            return True
        # Only a run that collected the entry's whole file can tell (a subset may not hold it).
        return any(entry.matches_file(file) for file in judged)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if _is_worker(self.config):
            return
        sections = " ".join(sorted(self.sections))
        title = f"skip accounting ({self.path.name}{f', without {sections}' if sections else ''})"
        if self.problems:
            terminalreporter.write_sep("=", title, red=True)
            for line in self.problems:
                terminalreporter.write_line(line, red=True)
        else:
            terminalreporter.write_sep("=", title, green=True)
            terminalreporter.write_line(f"{len(self.skipped)} skipped, each allowed")


def _count(n: int, noun: str, plural: str = "") -> str:
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    # A skip's longrepr is (path, line, "Skipped: reason"); through xdist it may be a list.
    if isinstance(longrepr, tuple | list) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_configure(config: pytest.Config) -> None:
    value = os.environ.get(ALLOW_LIST_ENV, "")
    if not value:
        return
    path = config.invocation_params.dir / value
    try:
        entries = parse_allow_list(path.read_text())
    except (OSError, AllowListError) as exc:
        raise pytest.UsageError(f"{ALLOW_LIST_ENV}={value}: {exc}") from exc
    config.pluginmanager.register(SkipAccounting(config, path, entries), "tokembed-skips")
