"""Settings: one definition gives the flag, the TOKEMBED_* variable and the help."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from tokembed.server.core.errors import ServerConfigError
from tokembed.server.process import cli
from tokembed.server.process.settings import ENV_PREFIX, MiB, Settings, shown

NAMES = [spec.name for spec in dataclasses.fields(Settings)]


def parse(argv: list[str], environ: dict[str, str] | None = None) -> Settings:
    parser = argparse.ArgumentParser()
    Settings.add_arguments(parser)
    return Settings.from_args(parser.parse_args(argv), environ or {})


def test_defaults_without_flags_or_environment() -> None:
    assert parse([]) == Settings()
    defaults = Settings()
    assert (defaults.host, defaults.port, defaults.device) == ("127.0.0.1", 50051, "cpu")
    assert defaults.max_delay_s == pytest.approx(defaults.max_delay_ms / 1000)
    assert defaults.max_message_bytes == defaults.max_output_bytes_per_request + MiB
    # A 64 MiB response fits the default message limit.
    assert defaults.max_message_bytes > 64 * MiB


@pytest.mark.parametrize(
    ("name", "raw", "value"),
    [
        ("port", "1234", 1234),
        ("max_delay_ms", "0.5", 0.5),
        ("model_dir", "/srv/model", (Path("/srv/model"),)),
        ("model_dir", "/srv/enc, /srv/dec,", (Path("/srv/enc"), Path("/srv/dec"))),
        ("default_model", "dec", "dec"),
        ("device", "auto", "auto"),
        ("host", "0.0.0.0", "0.0.0.0"),
        ("log_format", "json", "json"),
        ("auth_token_file", "tok.txt", Path("tok.txt")),
    ],
)
def test_environment_overrides_the_default(name: str, raw: str, value: Any) -> None:
    settings = parse([], {ENV_PREFIX + name.upper(): raw})
    assert getattr(settings, name) == value
    assert type(getattr(settings, name)) is type(value)


def test_flag_overrides_the_environment() -> None:
    environ = {"TOKEMBED_PORT": "1234", "TOKEMBED_DEVICE": "auto", "TOKEMBED_MAX_DELAY_MS": "9"}
    settings = parse(["--port", "4321", "--max-delay-ms", "3.5"], environ)
    assert settings.port == 4321
    assert settings.max_delay_ms == 3.5
    assert settings.device == "auto"  # no flag: the environment still counts


def test_empty_environment_value_means_unset() -> None:
    assert parse([], {"TOKEMBED_PORT": ""}).port == Settings().port


def test_unrelated_environment_is_ignored() -> None:
    assert parse([], {"PORT": "1", "TOKEMBED": "x", "tokembed_port": "2"}) == Settings()


def test_from_cli_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKEMBED_MAX_BATCH_TOKENS", "777")
    monkeypatch.setenv("TOKEMBED_PORT", "1111")
    settings = Settings.from_cli(["--port", "2222"])
    assert (settings.max_batch_tokens, settings.port) == (777, 2222)


@pytest.mark.parametrize(
    ("variable", "raw", "fragment"),
    [
        ("TOKEMBED_PORT", "abc", "is not a valid int"),
        ("TOKEMBED_MAX_BATCH_TOKENS", "1.5", "is not a valid int"),
        ("TOKEMBED_MAX_DELAY_MS", "soon", "is not a valid float"),
        ("TOKEMBED_DEVICE", "tpu", "is not one of ['cpu', 'cuda', 'auto']"),
        ("TOKEMBED_LOG_LEVEL", "INFO", "is not one of"),
    ],
)
def test_bad_environment_value_names_the_variable(variable: str, raw: str, fragment: str) -> None:
    with pytest.raises(ServerConfigError) as error:
        parse([], {variable: raw})
    assert f"{variable}={raw!r}" in str(error.value)
    assert fragment in str(error.value)


def test_values_from_the_environment_are_validated() -> None:
    with pytest.raises(ServerConfigError, match="max_batch_tokens must be positive, got 0"):
        parse([], {"TOKEMBED_MAX_BATCH_TOKENS": "0"})


def test_bad_flag_value_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(["--device", "tpu"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


def test_model_dir_is_given_once_per_model() -> None:
    settings = parse(["--model-dir", "enc", "--model-dir", "dec", "--default-model", "dec"])
    assert settings.model_dir == (Path("enc"), Path("dec"))
    assert settings.default_model == "dec"
    # Flags win over the variable as a whole, not merged with it.
    flags_win = parse(["--model-dir", "one"], {"TOKEMBED_MODEL_DIR": "a,b"})
    assert flags_win.model_dir == (Path("one"),)
    assert parse([]).model_dir == () and parse([]).default_model is None
    # One directory given as it is, as embedders and tests write it, is a tuple of one.
    assert Settings(model_dir=Path("m")).model_dir == (Path("m"),)  # type: ignore[arg-type]


POSITIVE = [
    "max_batch_tokens",
    "max_tokens_per_request",
    "max_output_bytes_per_request",
    "max_queued_tokens",
    "max_inflight_output_bytes",
    "stream_chunk_bytes",
    "max_concurrent_batches",
    "workers",
]


@pytest.mark.parametrize("name", POSITIVE)
@pytest.mark.parametrize("value", [0, -1])
def test_positive_settings(name: str, value: int) -> None:
    with pytest.raises(ServerConfigError, match=f"{name} must be positive, got {value}"):
        Settings().replace(**{name: value})


NON_NEGATIVE = [
    "max_delay_ms",
    "grace_s",
    "intra_op_threads",
    "inter_op_threads",
    "inline_compute_max_tokens",
    "float16_table_max_bytes",
    "float32_table_max_bytes",
    "memory_trim_interval_s",
]


@pytest.mark.parametrize("name", NON_NEGATIVE)
def test_non_negative_settings(name: str) -> None:
    with pytest.raises(ServerConfigError, match=f"{name} must not be negative, got -1"):
        Settings().replace(**{name: -1})
    assert getattr(Settings().replace(**{name: 0}), name) == 0


@pytest.mark.parametrize("name", ["max_delay_ms", "grace_s"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_durations_must_be_finite(name: str, value: float) -> None:
    # float("nan") parses from a flag or a variable and passes every "< 0" test.
    with pytest.raises(ServerConfigError, match=f"{name} must be a finite number"):
        Settings().replace(**{name: value})
    with pytest.raises(ServerConfigError, match=name):
        parse([], {ENV_PREFIX + name.upper(): str(value)})


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"port": -1}, "port must be in [0, 65535], got -1"),
        ({"port": 65536}, "port must be in [0, 65535], got 65536"),
        ({"metrics_port": -2}, "metrics_port must be in [-1, 65535], got -2"),
        ({"metrics_port": 70000}, "metrics_port must be in [-1, 65535]"),
        ({"tls_cert": Path("c.pem")}, "tls_cert and tls_key go together"),
        ({"tls_key": Path("k.pem")}, "tls_cert and tls_key go together"),
        ({"tls_client_ca": Path("ca.pem")}, "needs tls_cert and tls_key"),
        ({"workers": 2, "port": 0}, "workers > 1 needs a fixed port"),
        (
            {"workers": 3, "port": 1, "shared_memory": "system"},
            "--shared-memory system needs one process; got --workers 3",
        ),
        ({"default_model": ""}, "default_model must be a model's name"),
    ],
)
def test_validate_rules(changes: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ServerConfigError) as error:
        Settings().replace(**changes)
    assert fragment in str(error.value)


def test_valid_edge_values() -> None:
    assert Settings().replace(port=0).port == 0
    settings = Settings().replace(
        port=1,
        metrics_port=-1,
        tls_cert=Path("c.pem"),
        tls_key=Path("k.pem"),
        tls_client_ca=Path("ca.pem"),
        workers=4,
        max_delay_ms=0,
    )
    assert (settings.port, settings.metrics_port, settings.workers) == (1, -1, 4)
    assert Settings().replace(workers=2, port=65535).port == 65535


def test_help_lists_every_flag_and_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    parser = argparse.ArgumentParser(prog="tokembed")
    cli.add_parser(parser.add_subparsers())
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["serve", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo line wrapping
    for name in NAMES:
        assert "--" + name.replace("_", "-") in text, name
        assert f"env {ENV_PREFIX}{name.upper()};" in text, name
        assert f"default {shown(getattr(Settings(), name))}]" in text, name
    assert "[env TOKEMBED_MODEL_DIR; default unset]" in text
    assert len(NAMES) >= 25


def test_every_setting_has_help_text() -> None:
    for spec in dataclasses.fields(Settings):
        assert len(spec.metadata.get("help", "")) > 10, spec.name
