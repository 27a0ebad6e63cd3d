"""deploy/docker-compose: docker-compose, after a check that a container engine answers.

Where none does, one line on stderr that names the way out, exit status 2, and compose is
not run (it would print docker-py's traceback). The engines here are stand-ins on unix
sockets in a temporary folder, and compose is a stand-in that records its arguments, so
each case is exact; test_compose_stack.py runs the wrapper against podman for real.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy_files import ROOT, run

WRAPPER = ROOT / "deploy" / "docker-compose"
ROUTE = 'docs/deployment.md, "Without a Docker engine: podman"'
# What the wrapper needs besides bash builtins, taken from this machine.
TOOLS = ("bash", "python3", "realpath")


class FakeEngine:
    """A unix socket that answers every request with one HTTP status line."""

    def __init__(self, path: Path, status: str = "200 OK") -> None:
        self.path = path
        self._status = status
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(8)
        self.requests: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                self.requests.append(conn.recv(4096))
                body = b"OK"
                head = f"HTTP/1.1 {self._status}\r\nContent-Length: {len(body)}\r\n\r\n"
                conn.sendall(head.encode() + body)

    def close(self) -> None:
        # close() alone does not wake a thread blocked in accept(); shutdown() does.
        self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(5)
        assert not self._thread.is_alive()


@pytest.fixture
def sandbox(tmp_path: Path) -> Iterator[Path]:
    """A PATH with only the tools the wrapper uses, a `docker` without the compose plugin,
    and a `docker-compose` stand-in that writes its arguments to calls.jsonl."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        # python3 is this interpreter's own binary: the first python3 on PATH may be a
        # launcher script (pyenv's shims) that cannot run on the sandbox's PATH.
        found = Path(sys.executable).resolve() if tool == "python3" else shutil.which(tool)
        assert found is not None, tool
        (bin_dir / tool).symlink_to(found)
    _script(bin_dir / "docker", "exit 1  # no compose plugin")
    _script(
        bin_dir / "docker-compose",
        f"{sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "
        f'"$@" >>{tmp_path / "calls.jsonl"}',
    )
    yield tmp_path


def _script(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def _wrapper(sandbox: Path, *args: str, **env: str) -> tuple[int, str, str]:
    environ = {"PATH": str(sandbox / "bin"), "HOME": str(sandbox), **env}
    out = run([str(WRAPPER), *args], env=environ, cwd=sandbox, timeout=30)
    return out.returncode, out.stdout, out.stderr


def _calls(sandbox: Path) -> list[list[str]]:
    path = sandbox / "calls.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def _one_line_refusal(code: int, stdout: str, stderr: str) -> str:
    assert code == 2, (code, stdout, stderr)
    assert stdout == ""
    assert stderr.endswith("\n") and stderr.count("\n") == 1, stderr
    assert "Traceback" not in stderr
    assert stderr.startswith("deploy/docker-compose: ")
    return stderr.strip()


def test_no_engine_is_one_line_naming_the_podman_route(sandbox: Path) -> None:
    _script(sandbox / "bin" / "podman", "exit 0")
    absent = sandbox / "absent.sock"
    line = _one_line_refusal(
        *_wrapper(sandbox, "up", "-d", "--build", DOCKER_HOST=f"unix://{absent}")
    )
    assert line == (
        f"deploy/docker-compose: no Docker engine answers at unix://{absent} (DOCKER_HOST); "
        f"podman is installed: run the stack with it as {ROUTE} shows"
    )
    assert _calls(sandbox) == [], "compose must not run without an engine"
    # The place it points at exists.
    assert "\n## Without a Docker engine: podman\n" in (ROOT / "docs/deployment.md").read_text()


def test_no_engine_and_no_podman(sandbox: Path) -> None:
    """Unset DOCKER_HOST: the wrapper looks where compose would, /var/run/docker.sock."""
    if Path("/var/run/docker.sock").exists():
        pytest.skip("this machine has a Docker socket at /var/run/docker.sock")
    line = _one_line_refusal(*_wrapper(sandbox, "up"))
    assert line == (
        "deploy/docker-compose: no Docker engine answers at unix:///var/run/docker.sock; "
        f"start Docker, point DOCKER_HOST at an engine, or use podman as {ROUTE} shows"
    )
    assert _calls(sandbox) == []


def test_an_engine_that_answers_gets_the_arguments_unchanged(sandbox: Path) -> None:
    engine = FakeEngine(sandbox / "engine.sock")
    try:
        args = ["-f", "a file.yml", "up", "-d", "--build", "tokembed", "prometheus"]
        code, _, err = _wrapper(sandbox, *args, DOCKER_HOST=f"unix://{engine.path}")
    finally:
        engine.close()
    assert (code, err) == (0, ""), err
    assert _calls(sandbox) == [args]
    (ping,) = engine.requests
    assert ping.startswith(b"GET /_ping HTTP/1.")


def test_host_flag_wins_over_docker_host(sandbox: Path) -> None:
    engine = FakeEngine(sandbox / "engine.sock")
    try:
        args = ["-H", f"unix://{engine.path}", "ps"]
        code, _, err = _wrapper(sandbox, *args, DOCKER_HOST=f"unix://{sandbox}/absent.sock")
    finally:
        engine.close()
    assert (code, err) == (0, "")
    assert _calls(sandbox) == [args]


def test_something_else_on_the_socket_is_named(sandbox: Path) -> None:
    engine = FakeEngine(sandbox / "web.sock", status="404 Not Found")
    try:
        line = _one_line_refusal(*_wrapper(sandbox, "up", DOCKER_HOST=f"unix://{engine.path}"))
    finally:
        engine.close()
    assert "is not a container engine (GET /_ping did not return 200)" in line
    assert _calls(sandbox) == []


@pytest.mark.parametrize("args", [["config"], ["-f", "x.yml", "config", "-q"], ["version"]])
def test_commands_that_need_no_engine_are_not_checked(sandbox: Path, args: list[str]) -> None:
    code, _, err = _wrapper(sandbox, *args, DOCKER_HOST=f"unix://{sandbox}/absent.sock")
    assert (code, err) == (0, "")
    assert _calls(sandbox) == [args]


def test_no_compose_installed(sandbox: Path) -> None:
    (sandbox / "bin" / "docker-compose").unlink()
    line = _one_line_refusal(*_wrapper(sandbox, "up"))
    assert "neither `docker compose` nor `docker-compose` is installed" in line


def test_a_wrapper_on_path_does_not_call_itself(sandbox: Path) -> None:
    """deploy/ on PATH: `docker-compose` found there is the wrapper itself, skipped."""
    (sandbox / "bin" / "docker-compose").unlink()
    (sandbox / "bin" / "docker-compose").symlink_to(WRAPPER)
    line = _one_line_refusal(*_wrapper(sandbox, "config"))
    assert "neither `docker compose` nor `docker-compose` is installed" in line


def test_real_docker_compose_through_the_wrapper() -> None:
    """The real docker-compose, through the wrapper, validates the project's files."""
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (.ci/run installs it)")
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    out = run([str(WRAPPER), "config", "-q"], env=env, cwd=ROOT, timeout=60)
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
