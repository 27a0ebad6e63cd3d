"""``tokembed embed | info | health`` through the real dispatcher, against the real server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from client_support import SMALL_NAME, LoadingServer, rejections, requests_of

from tokembed.cli.client import parse_ids
from tokembed.cli.main import main
from tokembed.client import InvalidInputError

from support.fixtures import SMALL_D, SMALL_V
from support.ports import free_port
from support.server import ServerThread

VERSION = "1"  # what support.models exports every model as


def preview_first_value(out: str) -> float:
    """The first value of the array preview (the line after the shape line)."""
    return float(out.splitlines()[1].strip("[ ").split()[0])


def test_embed_prints_shape_preview_and_timings(
    real_server: ServerThread, small_rows: np.ndarray, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["embed", "--target", real_server.target, "--ids", "5 6 7 8 9 10 11 12"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines()[0] == f"hidden_states [1, 8, {SMALL_D}] float32, model small {VERSION}"
    # The preview prints 4 decimals of E[5][0].
    assert preview_first_value(out) == pytest.approx(float(small_rows[5, 0]), abs=5e-5)
    timings = re.search(
        r"server: queue (\S+) ms, compute (\S+) ms, total (\S+) ms; "
        r"batch of 1 request\(s\), 8 token\(s\)",
        out,
    )
    assert timings is not None, out
    queue, compute, total = (float(t) for t in timings.groups())
    # Printed to 1 us: a tiny look-up may show 0.000 ms of compute, never more than the total.
    assert queue >= 0 and 0 <= compute <= total and total > 0
    assert requests_of(real_server, "Embed") == 1


def test_embed_ragged_float16(
    real_server: ServerThread, small_rows: np.ndarray, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["embed", "--target", real_server.target, "--ids", "9,2,3; 4", "--dtype", "float16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"hidden_states [2, 3, {SMALL_D}] float16")
    assert "lengths [3, 1]" in out
    # float16 prints the shortest text that reads back as the same float16.
    shown = np.float16(preview_first_value(out.split("\n", 1)[1]))
    assert shown == small_rows[9, 0].astype(np.float16)
    assert main([*args, "--layout", "flat"]) == 0
    assert (
        capsys.readouterr().out.splitlines()[0].startswith(f"hidden_states [4, {SMALL_D}] float16")
    )


def test_embed_uses_the_token_file(
    start_server: Callable[..., ServerThread],
    small_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "server-token").write_text("tok\n")
    server = start_server(small_model_dir, auth_token_file=tmp_path / "server-token")
    (tmp_path / "token").write_text("tok\n")
    args = ["embed", "--target", server.target, "--ids", "1"]
    assert main([*args, "--token-file", str(tmp_path / "token")]) == 0
    assert requests_of(server, "Embed", code="OK") == 1
    assert main(args) == 2  # no token: UNAUTHENTICATED, one line, exit 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("tokembed embed: error: UNAUTHENTICATED")
    assert rejections(server, "unauthenticated") == 1


def test_embed_errors_are_one_line(
    real_server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    target = f"127.0.0.1:{free_port()}"
    assert main(["embed", "--target", target, "--ids", "1", "--timeout-s", "10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("tokembed embed: error: UNAVAILABLE")
    assert main(["embed", "--target", target, "--ids", "1 x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1  # refused before any call: the target is not even there
    assert err[0].startswith("tokembed embed: error: ") and "'x'" in err[0]
    # The server's refusal, as one line naming the offending id.
    assert main(["embed", "--target", real_server.target, "--ids", f"1 {SMALL_V}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("tokembed embed: error: INVALID_ARGUMENT (invalid_input)")
    assert f"input_ids[0,1] = {SMALL_V} is outside the vocabulary" in err[0]


def test_parse_ids() -> None:
    assert parse_ids("5 6 7 8") == [[5, 6, 7, 8]]
    assert parse_ids(" 1,2 ;3 ") == [[1, 2], [3]]
    with pytest.raises(InvalidInputError, match="sequence 1 is empty"):
        parse_ids("1 2;;3")


def test_info(real_server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--target", real_server.target]) == 0
    out = capsys.readouterr().out
    assert f"model              {SMALL_NAME} {VERSION}" in out
    assert f"vocab_size (V)     {SMALL_V}" in out
    assert f"d_model (D)        {SMALL_D}" in out
    assert "provider           CPUExecutionProvider" in out
    assert main(["info", "--target", real_server.target, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["name"], info["d_model"], info["padding_id"]) == (SMALL_NAME, SMALL_D, 0)
    assert info["limits"]["max_message_bytes"] == real_server.settings.max_message_bytes
    assert requests_of(real_server, "GetModelInfo") == 2


def test_health_exit_codes(loading: LoadingServer, capsys: pytest.CaptureFixture[str]) -> None:
    target = loading.server.target
    assert main(["health", "--target", target]) == 1  # port open, models loading
    assert capsys.readouterr().err.strip() == f"{target}: NOT_SERVING"
    loading.finish_loading()
    assert main(["health", "--target", target]) == 0
    assert capsys.readouterr().out.strip() == f"{target}: SERVING"
    assert main(["health", "--target", target, "--service", SMALL_NAME]) == 0
    capsys.readouterr()
    assert main(["health", "--target", target, "--service", "no.such"]) == 1
    assert "SERVICE_UNKNOWN" in capsys.readouterr().err


def test_health_of_an_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    target = f"127.0.0.1:{free_port()}"
    assert main(["health", "--target", target, "--timeout-s", "10"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"{target}: unhealthy: UNAVAILABLE")


def test_health_target_from_the_environment(
    real_server: ServerThread, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOKEMBED_TARGET", real_server.target)
    assert main(["health"]) == 0
    assert capsys.readouterr().out.strip() == f"{real_server.target}: SERVING"


def test_a_reader_that_goes_away_ends_the_command_quietly(real_server: ServerThread) -> None:
    """`tokembed embed ... | head -1`: the pipe's reader is gone before the command
    writes (here from the start, so the write fails every time). No traceback: the exit
    status a shell gives a process ended by SIGPIPE, and nothing on stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will ever read
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tokembed.cli", "embed", "--target", real_server.target,
             "--ids", "5 6 7"],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")
    assert requests_of(real_server, "Embed") == 1  # it did its work; only the printing failed


def test_help_does_not_load_grpc_or_numpy() -> None:
    code = (
        "import argparse, sys\n"
        "from tokembed.cli import client as cli\n"
        "p = argparse.ArgumentParser(); cli.add_parser(p.add_subparsers())\n"
        "print(sorted(m for m in ('grpc', 'numpy') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip() == "[]"


def test_embed_matches_the_library(
    real_server: ServerThread, small_rows: np.ndarray, capsys: pytest.CaptureFixture[str]
) -> None:
    # The CLI prints what the library returns: every previewed value of E[id] * 8, to 4
    # decimals (the preview shows the first and last two of each row).
    assert main(["embed", "--target", real_server.target, "--ids", "5"]) == 0
    row = capsys.readouterr().out.splitlines()[1].strip("[ ]").split("...")
    shown = [float(v) for v in row[0].split()] + [float(v) for v in row[1].split()]
    want = [*small_rows[5, :2], *small_rows[5, -2:]]
    assert shown == pytest.approx([float(w) for w in want], abs=5e-5)
