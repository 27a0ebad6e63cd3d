"""A client's string cannot forge a log line: names and request ids that carry a newline
and a whole fake line reach the real server's log (text and JSON) as one line each, their
control characters escaped."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc

from support.requests import embed_request, stub_for
from support.server import ServerProcess, serve_args

TEXT_FORGERY = "\n2026-01-01 00:00:00,000 INFO tokembed.forged: FORGED"
JSON_FORGERY = '\n{"ts": "x", "level": "info", "logger": "tokembed.forged", "message": "FORGED"}'
TEXT_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) \S+: ")


def _send_forgeries(target: str, forgery: str) -> None:
    """A model name, a request id (tokembed.v1) and an input name (V2), each carrying the
    forged line; every one of them is refused, and logged."""
    ids = np.array([[1, 2, 3]], dtype=np.int64)
    with stub_for(target) as stub:
        for request in (
            embed_request(ids, model_name="small" + forgery),
            embed_request(np.array([[10**6]]), request_id="r1" + forgery),
        ):
            with pytest.raises(grpc.RpcError):
                stub.Embed(request, timeout=10)
    with tc.InferenceServerClient(target) as client:
        tensor = tc.InferInput("input_ids" + forgery, list(ids.shape), "INT64")
        tensor.set_data_from_numpy(ids)
        with pytest.raises(tc.InferenceServerException):
            client.infer("small", [tensor], request_id="r2" + forgery, client_timeout=10)


def _log_of(model_dir: Path, log_format: str, forgery: str) -> list[str]:
    server = ServerProcess(
        serve_args(model_dir, "--log-format", log_format, "--log-level", "debug")
    ).start()
    try:
        _send_forgeries(server.target, forgery)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        finally:
            server.kill()
    return server.output.splitlines()


def test_no_forged_line_in_the_text_log(small_model_dir: Path) -> None:
    lines = _log_of(small_model_dir, "text", TEXT_FORGERY)
    carrying = [line for line in lines if "FORGED" in line]
    assert len(carrying) >= 3, lines  # each refusal logged, the forgery inside its line
    assert not [line for line in lines if line.startswith("2026-01-01 00:00:00,000")], lines
    for line in carrying:
        assert TEXT_LINE.match(line) and "\\n2026-01-01" in line, line


def test_no_forged_line_in_the_json_log(small_model_dir: Path) -> None:
    lines = _log_of(small_model_dir, "json", JSON_FORGERY)
    entries = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(entries) == len(lines), [line for line in lines if not line.startswith("{")]
    assert not [e for e in entries if e["logger"] == "tokembed.forged"], entries
    assert len([e for e in entries if "FORGED" in json.dumps(e)]) >= 3, entries
