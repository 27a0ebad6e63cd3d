"""Logs: a debug line per served request and per rejection, a warning for the first
rejection of each reason (the others are summed up per interval: tests/e2e/
test_refusal_log.py), JSON lines for log pipelines, and a start-up line that says what is
served and under which limits."""

from __future__ import annotations

import json
import logging
import re
import signal
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from support.requests import embed_request, ids_of, stub_for
from support.server import ServerProcess, ServerThread, serve_args, wait_for

SERVICER_LOGGER = "tokembed.server.servicer"
MiB = 1024 * 1024


def test_one_line_per_request_and_a_warning_for_the_first_rejection_of_each_reason(
    caplog: pytest.LogCaptureFixture,
    small_model_dir: Path,
    start_server: Callable[..., ServerThread],
) -> None:
    # An interval no test outlives: the summary of the rejections after the first of each
    # reason comes at the stop, after these checks.
    server = start_server(small_model_dir, max_tokens_per_request=64, log_summary_interval_s=3600)
    caplog.set_level(logging.DEBUG, logger=SERVICER_LOGGER)
    with stub_for(server.target) as stub:
        for k in range(3):
            stub.Embed(embed_request(ids_of(8, start=k)), timeout=10)
        for bad in (embed_request([[1000]]), embed_request([[-1]]), embed_request(ids_of(65))):
            with pytest.raises(grpc.RpcError):
                stub.Embed(bad, timeout=10)
        records = [r for r in caplog.records if r.name == SERVICER_LOGGER]

        served = [r for r in records if r.levelno == logging.DEBUG and " ok " in r.getMessage()]
        assert len(served) == 3
        for record in served:
            assert record.getMessage().startswith("Embed ok shape=[1, 8, 64] dtype=float32")
            assert (record.method, record.code) == ("Embed", "OK")  # type: ignore[attr-defined]
            assert record.protocol == "tokembed.v1"  # type: ignore[attr-defined]
        refused = [r for r in records if "rejected" in r.getMessage()]
        reasons = [r.reason for r in refused]  # type: ignore[attr-defined]
        assert reasons == ["invalid_input", "invalid_input", "too_large"]
        # The first of each reason in full, as a warning; a repeat at debug only.
        levels = [r.levelno for r in refused]
        assert levels == [logging.WARNING, logging.DEBUG, logging.WARNING]
        for record, reason in zip(refused, reasons, strict=True):
            assert reason in record.getMessage()
            assert (record.method, record.model) == ("Embed", "small")  # type: ignore[attr-defined]
        assert len(records) == 6  # one line per request, nothing more

        # Per-request lines are debug only: at info a served request writes nothing.
        caplog.set_level(logging.INFO, logger=SERVICER_LOGGER)
        caplog.clear()
        stub.Embed(embed_request(ids_of(8)), timeout=10)
        assert [r for r in caplog.records if r.name == SERVICER_LOGGER] == []


def test_json_logs_are_one_object_per_line_and_start_up_says_what_is_served(
    small_model_dir: Path,
) -> None:
    limits = {
        "--max-tokens-per-request": "4000",
        "--max-output-bytes-per-request": str(3 * MiB),
        "--max-batch-tokens": "2048",
        "--max-delay-ms": "3.5",
        "--max-queued-tokens": "50000",
        "--max-inflight-output-bytes": str(100 * MiB),
    }
    flags = [part for pair in limits.items() for part in pair]
    process = ServerProcess(
        serve_args(small_model_dir, "--log-format", "json", "--log-level", "debug", *flags)
    )
    try:
        process.start()
        with stub_for(process.target) as stub:
            for k in range(2):
                stub.Embed(embed_request(ids_of(8, start=k)), timeout=10)
            with pytest.raises(grpc.RpcError):
                stub.Embed(embed_request([[5, 1000]]), timeout=10)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        assert wait_for(lambda: '"stopped"' in process.output, 10), process.output
    finally:
        process.kill()

    lines = [line for line in process.lines if line.strip()]
    entries = []
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            pytest.fail(f"not a JSON line: {line!r}")
        assert isinstance(entry, dict), line
        assert {"ts", "level", "logger", "message"} <= set(entry), line
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", entry["ts"]), line
        entries.append(entry)

    served = [e for e in entries if e["logger"] == SERVICER_LOGGER and e["level"] == "debug"]
    assert [(e["method"], e["code"]) for e in served] == [("Embed", "OK")] * 2
    refused = [e for e in entries if e["logger"] == SERVICER_LOGGER and e["level"] == "warning"]
    assert [(e["reason"], e["code"]) for e in refused] == [("invalid_input", "INVALID_ARGUMENT")]
    assert "input_ids[0,1] = 1000" in refused[0]["message"]

    (loaded,) = [e for e in entries if e["message"].startswith("loaded model")]
    assert loaded["level"] == "info" and loaded["model"] == "small"
    manifest = json.loads((small_model_dir / "manifest.json").read_text())
    message = loaded["message"]
    assert f"loaded model small v{manifest['version']}" in message
    assert manifest["files"]["model.onnx"]["sha256"] in message
    assert "V=1000 D=64" in message
    assert "table backend on CPUExecutionProvider" in message
    assert loaded["backend"] == "table"
    (start_up,) = [e for e in entries if e["message"].startswith("serving model")]
    assert start_up["level"] == "info"
    message = start_up["message"]
    assert "serving model small (default small)" in message
    for effective in (
        "4000 tokens and 3145728 output bytes per request",
        "batches of 2048 tokens after at most 3.5 ms",
        "50000 queued tokens",
        "104857600 in-flight output bytes",
    ):
        assert effective in message, f"{effective!r} not in {message!r}"
