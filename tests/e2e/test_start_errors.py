"""The mistakes people make starting ``tokembed serve``, as a real process: each is one
line naming the thing and what to do, exit status 2, no traceback (``--log-level debug``
adds it); and a request over the message limit is refused like any other, and counted.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from support.ports import free_port
from support.requests import embed_request, reason_of, stub_for
from support.server import ServerThread


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokembed.cli", "serve", *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
    )  # fmt: skip


def serve_briefly(*args: str) -> subprocess.CompletedProcess[str]:
    """``serve`` for a mistake that must end it at once: were it to start instead, its
    whole process group (workers included) is ended after a bounded wait."""
    with subprocess.Popen(
        [sys.executable, "-m", "tokembed.cli", "serve", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    ) as process:  # fmt: skip
        try:
            out, err = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """Exit 2; stderr's last line is the error, holding every fragment; no traceback nor
    anything gRPC's C core or asyncio would print on the way out."""
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines, "nothing said"
    line = lines[-1]
    # "tokembed serve: error: ...", or "tokembed: error: ..." for what the top parser
    # finds (an argument no subcommand knows).
    assert line.startswith(("tokembed serve: error: ", "tokembed: error: ")), result.stderr
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    for noise in ("Traceback", "Exception ignored", "Event loop is closed", ".cc:"):
        assert noise not in result.stderr, result.stderr[-3000:]
    return line


@pytest.fixture
def listening() -> Iterator[int]:
    """A port some other program is listening on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def test_a_grpc_port_in_use(small_model_dir: Path, listening: int) -> None:
    result = serve("--model-dir", str(small_model_dir), "--port", str(listening),
                   "--metrics-port", "-1")  # fmt: skip
    assert_one_line_error(result, f"cannot listen on 127.0.0.1:{listening}", "in use", "--port")


def test_a_metrics_port_in_use(small_model_dir: Path, listening: int) -> None:
    result = serve("--model-dir", str(small_model_dir), "--port", "0",
                   "--metrics-port", str(listening))  # fmt: skip
    assert_one_line_error(
        result, f"cannot serve metrics on 127.0.0.1:{listening}", "in use", "--metrics-port"
    )


@pytest.mark.parametrize("kind", ["missing", "a file", "manifest is a directory"])
def test_an_unreadable_model_directory(tmp_path: Path, kind: str) -> None:
    where = tmp_path / "model"
    if kind == "a file":
        where.write_text("not a directory")
    elif kind == "manifest is a directory":
        (where / "manifest.json").mkdir(parents=True)
    result = serve("--model-dir", str(where), "--port", "0", "--metrics-port", "-1")
    assert_one_line_error(result, "invalid model directory", str(where))
    # Checked before binding: nothing was listening, so nothing stopped either.
    assert "listening on" not in result.stderr and "stopped" not in result.stderr


@pytest.mark.parametrize("layout", ["the checkpoint itself", "a directory of a checkpoint"])
def test_a_checkpoint_named_as_a_model_directory_says_how_to_make_one(
    tmp_path: Path, layout: str
) -> None:
    checkpoint = tmp_path / "llama" / "model.safetensors"
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(b"weights")
    where = checkpoint if layout == "the checkpoint itself" else checkpoint.parent
    result = serve("--model-dir", str(where), "--port", "0", "--metrics-port", "-1")
    line = assert_one_line_error(
        result, "invalid model directory", str(where), "tokembed export --weights",
        str(checkpoint),
    )  # fmt: skip
    if layout == "the checkpoint itself":
        assert "is a file, not a model directory" in line and "does not exist" not in line
    else:
        assert "holds a checkpoint (model.safetensors) but no manifest.json" in line
    assert "listening on" not in result.stderr


def test_a_default_model_nobody_serves_is_refused_before_binding(
    small_model_dir: Path,
) -> None:
    result = serve("--model-dir", str(small_model_dir), "--default-model", "enc",
                   "--port", "0", "--metrics-port", "-1")  # fmt: skip
    assert_one_line_error(result, "default_model 'enc' is not one of the models served", "'small'")
    assert "listening on" not in result.stderr


@pytest.mark.parametrize(
    ("args", "env", "fragments"),
    [
        (["--port", "abc"], {}, ["argument --port: invalid int value: 'abc'", "--help"]),
        (["--device", "tpu"], {}, ["argument --device: invalid choice: 'tpu'"]),
        (["--no-such-flag"], {}, ["unrecognized arguments: --no-such-flag"]),
        ([], {"TOKEMBED_MAX_DELAY_MS": "soon"}, ["TOKEMBED_MAX_DELAY_MS='soon'", "float"]),
        (["--max-batch-tokens", "0"], {}, ["max_batch_tokens must be positive, got 0"]),
    ],
    ids=["flag-type", "flag-choice", "unknown-flag", "variable", "rule"],
)
def test_a_bad_setting(args: list[str], env: dict[str, str], fragments: list[str]) -> None:
    result = serve(*args, env=env)
    line = assert_one_line_error(result, *fragments)
    assert result.stderr.strip() == line  # nothing but the line: no usage dump


def test_workers_with_system_shared_memory_is_refused(small_model_dir: Path) -> None:
    """Each worker process would keep its own regions: the cap multiplied by N, and an
    Unregister reaching one process of N. Refused before anything starts."""
    args = ["--model-dir", str(small_model_dir), "--workers", "2", "--port", str(free_port()),
            "--shared-memory", "system", "--metrics-port", "-1"]  # fmt: skip
    result = serve_briefly(*args)
    line = assert_one_line_error(result, "--shared-memory system", "--workers 2", "one process")
    assert result.stderr.strip() == line
    assert "listening on" not in result.stderr


def test_a_tls_file_that_does_not_parse(small_model_dir: Path, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    key.write_text("nonsense\n")
    result = serve("--model-dir", str(small_model_dir), "--port", "0", "--metrics-port", "-1",
                   "--tls-cert", str(cert), "--tls-key", str(key))  # fmt: skip
    assert_one_line_error(result, f"tls_cert {cert}", f"tls_key {key}", "not a PEM")


def test_debug_logging_adds_the_traceback(tmp_path: Path) -> None:
    result = serve("--model-dir", str(tmp_path / "missing"), "--port", "0",
                   "--metrics-port", "-1", "--log-level", "debug")  # fmt: skip
    assert result.returncode == 2
    assert "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("tokembed serve: error: ")


def test_a_request_over_the_message_limit_is_too_large_and_counted(
    small_model_dir: Path, start_server: Any
) -> None:
    server: ServerThread = start_server(small_model_dir, max_tokens_per_request=4096)
    limit = server.settings.max_request_bytes
    ids = np.zeros((1, 200_000), dtype="<i8")  # 1.6 MB: over 4096 x 18 + 1 MiB
    request = embed_request(ids)
    options = [("grpc.max_send_message_length", 64 << 20)]
    with stub_for(server.target, options=options) as stub:
        with pytest.raises(grpc.RpcError) as caught:
            stub.Embed(request, timeout=30)
        (answer,) = list(stub.EmbedStream(iter([request]), timeout=30))
    error: Any = caught.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reason_of(error) == "too_large"
    assert f"over the limit of {limit} bytes" in error.details()
    assert "max_tokens_per_request=4096" in error.details()
    assert "--max-tokens-per-request" in error.details()
    assert answer.error.reason == "too_large"  # inside a stream: one error answer
    assert server.metric("tokembed_rejections_total", {"reason": "too_large"}) == 2
    assert server.metric("tokembed_requests_total", {"code": "RESOURCE_EXHAUSTED"}) == 2
