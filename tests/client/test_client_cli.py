"""``tokembed embed | info | health`` through the real dispatcher, against the loopback fake
(standing in for the real server while that one is being written)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from client_fakes import FAKE_NAME, D, FakeServer, free_port, rows
from grpc_health.v1 import health_pb2

from tokembed.cli.main import main
from tokembed.client import InvalidInputError
from tokembed.client.cli import parse_ids
from tokembed.v1 import embedding_pb2 as pb


def test_embed_prints_shape_preview_and_timings(
    fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["embed", "--target", fake.address, "--ids", "5 6 7 8 9 10 11 12"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines()[0] == f"hidden_states [1, 8, {D}] float32, model {FAKE_NAME} 7"
    assert f"{rows(5)[0]:.0f}." in out  # the preview shows the first row's first value
    assert "server: queue 1.000 ms, compute 2.000 ms" in out


def test_embed_ragged_float16(fake: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["embed", "--target", fake.address, "--ids", "1,2,3; 4", "--dtype", "float16"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines()[0].startswith(f"hidden_states [2, 3, {D}] float16")
    assert "lengths [3, 1]" in out
    sent = fake.service.calls[-1].request
    assert sent.output_dtype == pb.DTYPE_FLOAT16
    assert list(sent.lengths) == [3, 1]


def test_embed_uses_the_token_file(
    fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.service.required_token = "tok"
    (tmp_path / "token").write_text("tok\n")
    args = ["embed", "--target", fake.address, "--ids", "1"]
    assert main([*args, "--token-file", str(tmp_path / "token")]) == 0
    assert main(args) == 2  # no token: UNAUTHENTICATED, one line, exit 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("tokembed embed: error: UNAUTHENTICATED")


def test_embed_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    target = f"127.0.0.1:{free_port()}"
    assert main(["embed", "--target", target, "--ids", "1", "--timeout-s", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("tokembed embed: error: UNAVAILABLE")
    assert main(["embed", "--target", target, "--ids", "1 x"]) == 2
    assert "invalid literal" in capsys.readouterr().err


def test_parse_ids() -> None:
    assert parse_ids("5 6 7 8") == [[5, 6, 7, 8]]
    assert parse_ids(" 1,2 ;3 ") == [[1, 2], [3]]
    with pytest.raises(InvalidInputError, match="sequence 1 is empty"):
        parse_ids("1 2;;3")


def test_info(fake: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--target", fake.address]) == 0
    out = capsys.readouterr().out
    assert f"model              {FAKE_NAME} 7" in out
    assert f"d_model (D)        {D}" in out
    assert "provider           FakeExecutionProvider" in out
    assert main(["info", "--target", fake.address, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["d_model"] == D
    assert info["limits"]["max_message_bytes"] == 64 * 1024 * 1024


def test_health_exit_codes(fake: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["health", "--target", fake.address]) == 0
    assert capsys.readouterr().out.strip() == f"{fake.address}: SERVING"
    fake.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert main(["health", "--target", fake.address]) == 1
    assert capsys.readouterr().err.strip() == f"{fake.address}: NOT_SERVING"
    assert main(["health", "--target", fake.address, "--service", "no.such"]) == 1
    assert "SERVICE_UNKNOWN" in capsys.readouterr().err


def test_health_of_an_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    target = f"127.0.0.1:{free_port()}"
    assert main(["health", "--target", target, "--timeout-s", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"{target}: unhealthy: UNAVAILABLE")


def test_health_target_from_the_environment(
    fake: FakeServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOKEMBED_TARGET", fake.address)
    assert main(["health"]) == 0
    assert fake.address in capsys.readouterr().out


def test_a_reader_that_goes_away_ends_the_command_quietly(fake: FakeServer) -> None:
    """`tokembed embed ... | head -1`: the pipe's reader is gone before the command
    writes (here from the start, so the write fails every time). No traceback: the exit
    status a shell gives a process ended by SIGPIPE, and nothing on stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will ever read
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tokembed.cli", "embed", "--target", fake.address,
             "--ids", "5 6 7"],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")
    assert fake.service.count("Embed") == 1  # it did its work; only the printing failed


def test_help_does_not_load_grpc_or_numpy() -> None:
    code = (
        "import argparse, sys\n"
        "from tokembed.client import cli\n"
        "p = argparse.ArgumentParser(); cli.add_parser(p.add_subparsers())\n"
        "print(sorted(m for m in ('grpc', 'numpy') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip() == "[]"


def test_embed_matches_the_library(fake: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    # The CLI prints what the library returns: the preview's first value is E[5][0].
    main(["embed", "--target", fake.address, "--ids", "5"])
    out = capsys.readouterr().out
    first = float(out.splitlines()[1].strip("[ ").split()[0])
    assert first == float(np.float32(rows(5)[0]))
