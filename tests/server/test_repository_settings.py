"""The model repository's flags and their rules: each mistake one clear line, before
anything listens; and what a repository on disk is read as (versions, policies,
complete or not)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokembed.server.core.errors import InvalidInput, ServerConfigError
from tokembed.server.models.model_repository import (
    LATEST_ONE,
    ModelRepositoryDir,
    VersionPolicy,
    check_config,
    version_policy,
)
from tokembed.server.process.settings import Settings


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--model-dir", "a", "--model-repository", "r"], "exclude each other"),
        (["--load-model", "x"], "--load-model needs --model-repository"),
        (["--model-control-mode", "poll"], "needs --model-repository"),
        (["--model-repository", "r", "--model-control-mode", "poll", "--load-model", "x"],
         "goes with --model-control-mode explicit"),
        (["--model-repository", "r", "--repository-poll-secs", "0"],
         "repository_poll_secs must be a positive number"),
        (["--model-repository", "r", "--workers", "2", "--port", "5000"],
         "explicit needs one process"),
        (["--max-model-memory-bytes", "-1"], "must not be negative"),
    ],
)  # fmt: skip
def test_each_mistake_is_one_line_naming_it(argv: list[str], words: str) -> None:
    with pytest.raises(ServerConfigError, match=words):
        Settings.from_cli(argv)


def test_the_mode_defaults_to_explicit_with_a_repository_and_none_without() -> None:
    assert Settings.from_cli(["--model-repository", "r"]).control_mode == "explicit"
    assert Settings.from_cli([]).control_mode == "none"
    poll = ["--model-repository", "r", "--model-control-mode", "poll", "--workers", "2"]
    assert Settings.from_cli([*poll, "--port", "5000"]).control_mode == "poll"


@pytest.mark.parametrize(
    ("policy", "available", "chosen"),
    [
        ({"latest": {"num_versions": 2}}, [1, 3, 2, 7], [3, 7]),
        ({"latest": {}}, [1, 2], [2]),
        ({"all": {}}, [2, 1], [1, 2]),
        ({"specific": {"versions": [1, 3, "9"]}}, [1, 2, 3], [1, 3]),
    ],
)
def test_version_policies_choose_as_triton_s(
    policy: dict[str, object], available: list[int], chosen: list[int]
) -> None:
    assert version_policy(policy, "here").choose(available) == chosen


@pytest.mark.parametrize(
    ("policy", "words"),
    [
        ({"newest": {}}, "'newest' is not one of"),
        ({"latest": {"num_versions": 0}}, "num_versions must be >= 1"),
        ({"specific": {"versions": [0]}}, "positive integers"),
        ({"specific": {"versions": []}}, "positive integers"),
        ("latest", "must be one of"),
    ],
)
def test_a_policy_that_cannot_be_honoured_is_refused_naming_it(policy: object, words: str) -> None:
    with pytest.raises(InvalidInput, match=words):
        version_policy(policy, "here")


def test_a_config_may_set_the_version_policy_and_nothing_else() -> None:
    assert check_config("m", {"name": "m"}, "here") is None
    assert check_config("m", {"version_policy": {"all": {}}}, "here") == VersionPolicy("all")
    with pytest.raises(InvalidInput, match="cannot override 'backend', 'max_batch_size'"):
        check_config("m", {"max_batch_size": 8, "backend": "onnx"}, "here")
    with pytest.raises(InvalidInput, match="differs from the model's"):
        check_config("m", {"name": "other"}, "here")


def test_the_repository_on_disk(tmp_path: Path) -> None:
    (tmp_path / "enc" / "1").mkdir(parents=True)
    (tmp_path / "enc" / "02").mkdir()  # not a version: versions are written plainly
    (tmp_path / "enc" / "x").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "dec").mkdir()
    (tmp_path / "dec" / "config.json").write_text(json.dumps({"version_policy": {"all": {}}}))
    disk = ModelRepositoryDir(tmp_path)
    assert disk.models() == ["dec", "enc"]
    (version,) = disk.versions("enc")
    assert version.number == 1 and "no manifest.json" in version.incomplete
    assert disk.policy("enc") == LATEST_ONE
    assert disk.policy("dec") == VersionPolicy("all")
    assert not disk.has("../enc") and not disk.has("") and disk.has("enc")
    (tmp_path / "dec" / "config.json").write_text("{")
    with pytest.raises(InvalidInput, match="not valid JSON"):
        disk.policy("dec")
