"""What a newcomer meets on the command line: ``tokembed models``, ``health --service``,
``embed --dtype``'s help and a bad ``--ids``, through the real dispatcher and, where a
server answers, the real server."""

from __future__ import annotations

import subprocess
import sys
import typing
from collections.abc import Callable
from pathlib import Path

import pytest

from tokembed.cli.main import main
from tokembed.client import EmbeddingClient, codec

from support.fixtures import DECODER_D, DECODER_V, EVERY_BACKEND, SMALL_D, SMALL_V
from support.server import ServerThread

# Nothing listens here: the commands below that use it must fail before connecting.
NO_SERVER = "127.0.0.1:9"


@pytest.mark.parametrize(
    ("ids", "bad", "sequence"),
    [("1.5", "1.5", 0), ("5 6; 7 abc", "abc", 1), ("3,1e3", "1e3", 0), ("0x10", "0x10", 0)],
)
def test_a_bad_id_is_one_line_naming_it(
    ids: str, bad: str, sequence: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["embed", "--target", NO_SERVER, "--ids", ids]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"tokembed embed: error: --ids: {bad!r} (sequence {sequence}) is not a token id: ids "
        'are integers separated by spaces or commas, sequences by ";"\n'
    )


def test_embed_dtype_help_lists_what_the_client_accepts() -> None:
    accepted = typing.get_args(codec.OutputDType)
    assert accepted, "the client's OutputDType names no dtype"
    for name in accepted:
        codec.output_dtype_code(name)  # the codec takes every name listed
    result = subprocess.run(
        [sys.executable, "-m", "tokembed.cli", "embed", "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps to the terminal's width
    assert (
        f"--dtype DTYPE dtype of the answer, one of: {', '.join(accepted)} (default float32;"
        in text
    )


def test_dtype_choices_do_not_load_numpy_for_other_commands() -> None:
    """The module's claim: building the parser, and parsing a command that gives no
    --dtype, import neither numpy nor grpc."""
    code = (
        "import sys; from tokembed.cli.main import build_parser; "
        "build_parser().parse_args(['embed', '--ids', '1']); "
        "print(sorted(m for m in ('numpy', 'grpc') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n"


def test_embed_takes_each_listed_dtype(
    start_server: Callable[..., ServerThread],
    small_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = start_server(small_model_dir)
    for name in typing.get_args(codec.OutputDType):
        assert main(["embed", "--target", server.target, "--ids", "1 2", "--dtype", name]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert first == f"hidden_states [1, 2, {SMALL_D}] {name}, model small 1"


def test_health_names_the_service_it_checked(
    start_server: Callable[..., ServerThread],
    small_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = start_server(small_model_dir)
    target = server.target

    assert main(["health", "--target", target]) == 0
    assert capsys.readouterr().out == f"{target}: SERVING\n"  # the whole server

    assert main(["health", "--target", target, "--service", "small"]) == 0
    assert capsys.readouterr().out == f"{target} service 'small': SERVING\n"

    assert main(["health", "--target", target, "--service", "tokembed.v1.EmbeddingService"]) == 0
    assert capsys.readouterr().out == f"{target} service 'tokembed.v1.EmbeddingService': SERVING\n"

    assert main(["health", "--target", target, "--service", "nope"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"{target} service 'nope': SERVICE_UNKNOWN (the server has no such service: each "
        "served model has one under its name)\n"
    )


@EVERY_BACKEND
def test_models_prints_one_line_per_model(
    backend: dict[str, int],
    start_server: Callable[..., ServerThread],
    small_model_dir: Path,
    decoder_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The default is the second model given, so the mark follows --default-model, not order.
    server = start_server((small_model_dir, decoder_model_dir), default_model="decoder", **backend)
    assert main(["models", "--target", server.target]) == 0
    lines = capsys.readouterr().out.splitlines()
    kind = "onnxruntime" if backend else "table"
    with EmbeddingClient(server.target) as client:
        held = {info.name: sum(info.memory_bytes.values()) for info in client.models()}
    if not backend:  # the float32, float16 and bfloat16 tables: V x D x 8 bytes
        assert held == {"small": SMALL_V * SMALL_D * 8, "decoder": DECODER_V * DECODER_D * 8}
    memory = {name: f"{count / 1024:.1f} KiB" if count < 2**20 else f"{count / 2**20:.1f} MiB"
              for name, count in held.items()}  # fmt: skip
    assert [line.split() for line in lines] == [
        ["MODEL", "VERSION", "KIND", "V", "D", "WEIGHTS", "BACKEND", "MEMORY", "DEFAULT"],
        ["small", "1", "token", str(SMALL_V), str(SMALL_D), "float32", kind,
         *memory["small"].split()],
        ["decoder", "1", "token", str(DECODER_V), str(DECODER_D), "float32", kind,
         *memory["decoder"].split(), "*"],
    ]  # fmt: skip
    # Columns line up: each header starts where its values do (V, D and the memory,
    # numbers, end there).
    header = lines[0]
    v_end, d_end = header.index(" V ") + 2, header.index(" D ") + 2
    memory_end = header.index("MEMORY") + len("MEMORY")
    for line in lines[1:]:
        assert line.index("token") == header.index("KIND")
        assert line.index("float32") == header.index("WEIGHTS")
        assert line.index(kind) == header.index("BACKEND")
        assert line[:v_end].endswith(" " + line.split()[3])
        assert line[:d_end].endswith(" " + line.split()[4])
        assert line[:memory_end].endswith(memory[line.split()[0]])


def test_models_against_no_server_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "--target", NO_SERVER, "--timeout-s", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokembed models: error: ") and err.count("\n") == 1, err
