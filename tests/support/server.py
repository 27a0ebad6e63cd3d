"""The real server for end-to-end tests: in a thread (fast, metrics readable) or as a
``tokembed serve`` process (signals, exit codes)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from tokembed.server.app import TokembedServer
from tokembed.server.models.loading import ModelLoader, load_model
from tokembed.server.process.settings import Settings

from support.metrics import total

T = TypeVar("T")


class ServerThread:
    """``TokembedServer`` on port 0, on its own event loop in a background thread."""

    def __init__(self, settings: Settings, *, loader: ModelLoader = load_model) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        self._loader = loader
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.server: TokembedServer | None = None

    def start(self, *, wait_ready: bool = True, timeout_s: float = 60) -> ServerThread:
        self._thread.start()
        self.server = self.call(self._start(), timeout_s)
        if wait_ready:
            self.call(self.server.wait_ready(), timeout_s)
        return self

    async def _start(self) -> TokembedServer:
        server = TokembedServer(self.settings, registry=self.registry, loader=self._loader)
        await server.start()
        return server

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout_s)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_port(self) -> int:
        assert self.server is not None and self.server.metrics_port is not None
        return self.server.metrics_port

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """The sum of the samples ``name`` whose labels include ``labels`` (so, with
        several models served, over every model unless ``model`` is given), read from the
        server's registry (``support.metrics.total``)."""
        return total(self.registry, name, labels)

    def stop(self, grace_s: float = 5) -> None:
        if self.server is not None and self._thread.is_alive():
            self.call(self.server.stop(grace_s), timeout_s=grace_s + 30)
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()


_LISTENING = re.compile(r"listening on (\S+):(\d+) \(gRPC")
_METRICS = re.compile(r"metrics on http://[^:]+:(\d+)/metrics")


class ServerProcess:
    """``tokembed serve`` as a child process; learns its port from the start-up log."""

    def __init__(
        self,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        *,
        tokembed: Sequence[str] = (sys.executable, "-m", "tokembed.cli"),
    ) -> None:
        # tokembed: the command, where another environment's (a fresh install's) is run.
        self.args = [*tokembed, "serve", *args]
        self.env = {**os.environ, **(env or {})}
        self.lines: list[str] = []
        self.port = 0
        self.metrics_port = 0
        self.exited_at = 0.0  # time.monotonic() when wait() saw the process end
        self._port_found = threading.Event()
        self._ready = threading.Event()
        self.process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self, *, wait_ready: bool = True, timeout_s: float = 120) -> ServerProcess:
        self.process = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._port_found.wait(timeout_s):
            self.kill()
            raise RuntimeError("server did not start:\n" + self.output)
        if wait_ready and not self._ready.wait(timeout_s):
            self.kill()
            raise RuntimeError("server did not become ready:\n" + self.output)
        return self

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            if match := _LISTENING.search(line):
                self.port = int(match.group(2))
                if metrics := _METRICS.search(line):
                    self.metrics_port = int(metrics.group(1))
                self._port_found.set()
            if "serving model" in line:
                self._ready.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def send_signal(self, signum: int = signal.SIGTERM) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def wait(self, timeout_s: float) -> int:
        assert self.process is not None
        code = self.process.wait(timeout_s)
        self.exited_at = time.monotonic()  # before the pipe is drained, which takes a while
        self._close_pipe()
        return code

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self._close_pipe()

    def _close_pipe(self) -> None:
        # The reader thread ends at EOF; give it a moment, then close our end.
        if self._reader is not None:
            self._reader.join(5)
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()


def wait_for(predicate: Any, timeout_s: float, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


async def wait_for_async(predicate: Any, timeout_s: float, interval_s: float = 0.02) -> bool:
    """wait_for from inside a coroutine: the event loop goes on (so the test's own calls
    still reach the server) while the predicate is polled."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(interval_s)
    return bool(predicate())


def serve_args(model_dir: Path, *extra: str) -> list[str]:
    return ["--model-dir", str(model_dir), "--port", "0", "--metrics-port", "0", *extra]
