"""The skip accounting CI turns on (tests/support/skips.py): pytest runs of small test files
in a temporary folder, serial and on two xdist workers, checked by exit status and output."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.skips import ALLOW_LIST_ENV, SECTIONS_ENV, AllowListError, parse_allow_list

pytest_plugins = ["pytester"]

TESTS_DIR = Path(__file__).resolve().parent
XDIST = ("-p", "xdist", "-n", "2")  # named: the runs load no plugin by themselves

SUITE = """
import pytest

def test_runs():
    pass

def test_needs_frobnicator():
    pytest.skip("frobnicator is not installed")

@pytest.mark.skipif(True, reason="needs a GPU")
@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_gpu(device):
    pass

@pytest.fixture
def tool():
    pytest.skip("the tool is missing")

def test_uses_tool(tool):
    pass

@pytest.mark.xfail(reason="known bug", strict=True)
def test_known_bug():
    assert False
"""

ALLOW_GPU = "test_suite.py::test_gpu[*]  # needs a CUDA GPU\n"
ALLOW_REST = (
    "test_suite.py::test_needs_frobnicator  # frobnicator is optional\n"
    "test_suite.py::test_uses_tool  # the tool is optional\n"
)


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    # The plugin is imported by name, in this process and in xdist's worker processes.
    monkeypatch.setenv("PYTHONPATH", str(TESTS_DIR))
    # Only the plugins a run names (-p): loading every installed one costs each process ~2 s.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv(ALLOW_LIST_ENV, raising=False)
    monkeypatch.delenv(SECTIONS_ENV, raising=False)
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def _run(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    allow_list: str | None,
    *args: str,
    subprocess: bool = False,
) -> pytest.RunResult:
    if allow_list is not None:
        (pytester.path / "allowed.txt").write_text(allow_list)
        monkeypatch.setenv(ALLOW_LIST_ENV, "allowed.txt")
    run = pytester.runpytest_subprocess if subprocess else pytester.runpytest
    return run("-p", "support.skips", "-p", "no:cacheprovider", *args)


def test_without_the_variable_skips_pass_as_usual(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run(suite, monkeypatch, None)
    result.assert_outcomes(passed=1, skipped=4, xfailed=1)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.no_fnmatch_line("*skip accounting*")


def test_a_skip_outside_the_list_fails_the_run_naming_it_and_its_reason(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run(suite, monkeypatch, ALLOW_GPU + "test_suite.py::test_uses_tool  # optional\n")
    result.assert_outcomes(passed=1, skipped=4, xfailed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*skip accounting (allowed.txt)*",
            "1 test skipped that allowed.txt does not allow*",
            "  test_suite.py::test_needs_frobnicator: frobnicator is not installed",
        ]
    )
    # The allowed ones (a skipif mark, a skip in a fixture) and the xfail are not named.
    result.stdout.no_fnmatch_line("  test_suite.py::test_gpu*")
    result.stdout.no_fnmatch_line("  test_suite.py::test_uses_tool*")
    result.stdout.no_fnmatch_line("  test_suite.py::test_known_bug*")


def test_skips_that_are_all_allowed_pass(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run(suite, monkeypatch, ALLOW_GPU + ALLOW_REST)
    result.assert_outcomes(passed=1, skipped=4, xfailed=1)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*skip accounting (allowed.txt)*", "4 skipped, each allowed"])


def test_a_skip_in_a_fixture_is_counted(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    allow_list = ALLOW_GPU + "test_suite.py::test_needs_frobnicator  # optional\n"
    result = _run(suite, monkeypatch, allow_list)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["  test_suite.py::test_uses_tool: the tool is missing"])


def test_a_module_skipped_at_collection_is_counted(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite.makepyfile(
        test_other="import pytest\npytest.skip('no backend', allow_module_level=True)\n"
    )
    result = _run(suite, monkeypatch, ALLOW_GPU + ALLOW_REST)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["  test_other.py: no backend"])


def test_an_entry_matching_no_collected_test_fails_the_run(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    allow_list = ALLOW_GPU + ALLOW_REST + "test_suite.py::test_renamed  # gone\n"
    result = _run(suite, monkeypatch, allow_list)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "1 entry of allowed.txt matches no collected test*",
            "  line 4: test_suite.py::test_renamed",
        ]
    )


def test_an_entry_naming_a_missing_file_is_stale(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    allow_list = ALLOW_GPU + ALLOW_REST + "test_gone.py::test_a  # gone\n"
    result = _run(suite, monkeypatch, allow_list)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["  line 4: test_gone.py::test_a"])


def test_entries_of_files_this_run_did_not_collect_are_not_judged(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite.makepyfile(test_other="def test_a():\n    pass\n")
    allow_list = ALLOW_GPU + ALLOW_REST + "test_other.py::test_renamed  # a subset run\n"
    result = _run(suite, monkeypatch, allow_list, "test_suite.py")
    assert result.ret == pytest.ExitCode.OK
    # The same list, when the run collects that file, is stale.
    result = _run(suite, monkeypatch, allow_list)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["  line 4: test_other.py::test_renamed"])


def test_a_run_of_chosen_node_ids_judges_no_entry_of_their_file(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pytest file.py::test_x` collects one test of the file, not the file."""
    allow_list = ALLOW_GPU + ALLOW_REST + "test_suite.py::test_renamed  # gone\n"
    result = _run(suite, monkeypatch, allow_list, "test_suite.py::test_runs")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK


def test_deselected_tests_count_as_collected(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run(suite, monkeypatch, ALLOW_GPU + ALLOW_REST, "-k", "not gpu and not tool")
    result.assert_outcomes(passed=1, skipped=1, xfailed=1, deselected=3)
    assert result.ret == pytest.ExitCode.OK


def test_xdist_controller_sees_the_workers_skips_and_collections(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers: the verdict is the controller's, from its workers' reports and the ids
    they collected (deselected ones too)."""
    suite.makepyfile(test_more="def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    allow_list = (
        ALLOW_GPU
        + "test_suite.py::test_uses_tool  # optional\n"
        + "test_more.py::test_b  # deselected below: collected all the same\n"
        + "test_more.py::test_c  # gone\n"
    )
    result = _run(suite, monkeypatch, allow_list, *XDIST, "-k", "not test_b", subprocess=True)
    result.assert_outcomes(passed=2, skipped=4, xfailed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "2 workers *7 items*",
            "1 test skipped that allowed.txt does not allow*",
            "  test_suite.py::test_needs_frobnicator: frobnicator is not installed",
            "1 entry of allowed.txt matches no collected test*",
            "  line 4: test_more.py::test_c",
        ]
    )

    result = _run(suite, monkeypatch, ALLOW_GPU + ALLOW_REST, *XDIST, subprocess=True)
    result.assert_outcomes(passed=3, skipped=4, xfailed=1)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.stdout.fnmatch_lines(["4 skipped, each allowed"])


def test_a_failed_run_stays_failed(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    suite.makepyfile(test_other="def test_broken():\n    assert False\n")
    result = _run(suite, monkeypatch, ALLOW_GPU + ALLOW_REST)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, failed=1, skipped=4, xfailed=1)


SECTIONED = (
    ALLOW_GPU
    + "test_suite.py::test_uses_tool  # optional\n"
    + "[needs frobnicator]\n"
    + "test_suite.py::test_needs_frobnicator  # runs the frobnicator\n"
)


def test_a_section_allows_its_tests_only_when_named(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run(suite, monkeypatch, SECTIONED)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["  test_suite.py::test_needs_frobnicator: *"])

    monkeypatch.setenv(SECTIONS_ENV, "frobnicator")
    result = _run(suite, monkeypatch, SECTIONED)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*skip accounting (allowed.txt, without frobnicator)*"])


def test_a_section_that_does_not_exist_is_a_usage_error(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECTIONS_ENV, "frobnicator widget")
    result = _run(suite, monkeypatch, SECTIONED)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"{SECTIONS_ENV} names ['widget']" in result.stderr.str()


def test_an_allow_list_that_cannot_be_read_is_a_usage_error(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run(suite, monkeypatch, "test_suite.py::test_gpu[*]\n")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*line 1: `test_suite.py::test_gpu[[]*]` says no reason*"])
    monkeypatch.setenv(ALLOW_LIST_ENV, "missing.txt")
    result = _run(suite, monkeypatch, None)
    assert result.ret == pytest.ExitCode.USAGE_ERROR


def test_parse_allow_list_entries_and_errors() -> None:
    entries = parse_allow_list(
        "# comment\n\n"
        "a.py::t[x y#1]  # ids hold spaces and #\n"
        "[needs pkg]\n"
        "a.py::u  # in a section\n"
    )
    assert [(e.pattern, e.reason, e.line, e.section) for e in entries] == [
        ("a.py::t[x y#1]", "ids hold spaces and #", 3, None),
        ("a.py::u", "in a section", 5, "pkg"),
    ]
    # `*` is the only wildcard: brackets and dots are literal.
    (wild,) = parse_allow_list("a.py::t[*]  # any id\n")
    assert wild.matches("a.py::t[1]") and wild.matches("a.py::t[a-b c]")
    assert not wild.matches("a.py::t") and not wild.matches("a.py::tt[1]")
    (exact,) = parse_allow_list("a.py::t[1]  # one\n")
    assert exact.matches("a.py::t[1]") and not exact.matches("a.py::t1")
    for bad, message in (
        ("a.py::t\n", "says no reason"),
        ("a.py  # not a test\n", "not a test's node id"),
        ("[needs pkg]\na.py::t[*]  # wild\n", "one test per entry"),
        ("[pkg]\n", "section heading"),
    ):
        with pytest.raises(AllowListError, match=message):
            parse_allow_list(bad)


def test_the_repository_allow_list_parses_with_a_reason_per_entry() -> None:
    entries = parse_allow_list((TESTS_DIR / "expected_skips.txt").read_text())
    always = [e.pattern for e in entries if e.section is None]
    assert always == [
        "tests/server/test_sessions.py::test_cuda_provider_runs_the_look_up[cuda]",
        "tests/server/test_sessions.py::test_cuda_provider_runs_the_look_up[auto]",
        "tests/server/test_head_graph.py::test_cuda_provider_runs_the_head_exactly[float32]",
        "tests/server/test_head_graph.py::test_cuda_provider_runs_the_head_exactly[bfloat16]",
        "tests/reliability/test_soak.py::test_soak_long",
        "tests/server/test_shm_registry.py::test_an_object_of_another_user_is_refused",
    ]
    assert all(e.reason for e in entries)
