"""Child processes the harness starts: the service (``tokembed serve``) and the floor."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

_SERVICE_PORT = re.compile(r"listening on \S+:(\d+) \(gRPC")
_FLOOR_PORT = re.compile(r"floor listening on \S+:(\d+)")


class Child:
    """A child process whose port (and readiness) are read from its output."""

    def __init__(
        self,
        args: Sequence[str],
        port_pattern: re.Pattern[str],
        ready_text: str,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.args = list(args)
        self._env = None if env is None else {**os.environ, **env}
        self._port_pattern = port_pattern
        self._ready_text = ready_text
        self.port = 0
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.process: subprocess.Popen[str] | None = None
        self._reader = threading.Thread()

    def start(self, timeout_s: float = 180) -> Child:
        self.process = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self._env
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout_s):
            self.stop()
            raise RuntimeError(f"{self.args[:4]} did not start:\n{''.join(self.lines[-20:])}")
        return self

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            if len(self.lines) < 1000:
                self.lines.append(line)
            if match := self._port_pattern.search(line):
                self.port = int(match.group(1))
            if self._ready_text in line and self.port:
                self._ready.set()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self.process is not None and self.process.stdout is not None:
            # The reader ends at the pipe's end (the process is gone); then the pipe is
            # closed here, not left to the garbage collector (a ResourceWarning).
            self._reader.join(10)
            if not self._reader.is_alive():
                self.process.stdout.close()

    def __enter__(self) -> Child:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.stop()


def service(model_dir: str, *extra: str, env: Mapping[str, str] | None = None) -> Child:
    """``tokembed serve``; ``env``: variables added to this process's for it alone (the
    deployment's allocator settings, say)."""
    args = [sys.executable, "-m", "tokembed.cli", "serve", "--model-dir", model_dir,
            "--port", "0", "--metrics-port", "-1", "--log-level", "info", *extra]  # fmt: skip
    return Child(args, _SERVICE_PORT, "serving model", env)


def floor(d_model: int) -> Child:
    args = [sys.executable, "-m", "tokembed.bench.floor", "--port", "0", "--d-model", str(d_model)]
    return Child(args, _FLOOR_PORT, "floor listening")
