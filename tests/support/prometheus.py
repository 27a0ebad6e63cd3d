"""A real Prometheus server for tests: Debian's ``prometheus`` binary on a free loopback
port, its storage in a folder of the test's, configured from the repository's own
``deploy/prometheus/prometheus.yml`` (only the intervals and the targets change).

    with running_prometheus(["127.0.0.1:<metrics port>"], workdir) as prometheus:
        prometheus.wait_until("up ...", lambda v: v == 1)

The process is ended when the ``with`` block ends, whatever happened in it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
REPO_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
JOB = "tokembed"
SCRAPE_INTERVAL_S = 0.25
WAIT_LIMIT_S = 60.0


def binary(name: str) -> str:
    """The path of ``prometheus`` or ``promtool``; the test skips without it."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (CI installs Debian's prometheus package)")
    return path


def _get_json(url: str) -> Any:
    assert url.startswith("http://127.0.0.1:"), "tests talk to loopback only"
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def repo_config_for(targets: Sequence[str], workdir: Path) -> Path:
    """The repository's scrape config, pointed at ``targets``, scraping every 250 ms.

    The job, its path, scheme and relabelling stay the repository's; its target files
    (file_sd, beside the config) are written into ``workdir`` naming ``targets`` only.
    """
    config = yaml.safe_load(REPO_CONFIG.read_text())
    interval = f"{int(SCRAPE_INTERVAL_S * 1000)}ms"
    config.setdefault("global", {}).update(
        scrape_interval=interval, scrape_timeout=interval, evaluation_interval="1s"
    )
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == JOB]
    job.pop("scrape_interval", None)
    job.pop("scrape_timeout", None)
    groups = [{"targets": list(targets)}]
    assert "static_configs" in job or "file_sd_configs" in job, job
    if "static_configs" in job:
        job["static_configs"] = groups
    for file_sd in job.get("file_sd_configs", []):
        for pattern in file_sd["files"]:
            name = Path(pattern.replace("*", "tokembed-test"))
            path = name if name.is_absolute() else workdir / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump(groups))
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class Prometheus:
    """One Prometheus process on a free loopback port, its storage under ``workdir``."""

    def __init__(self, config: Path, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        self.started_at = time.time()
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [
                    binary("prometheus"),
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    @property
    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.process.returncode}):\n{self.logs}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"prometheus not ready after {timeout_s} s:\n{self.logs}")

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; the answer's ``data`` (the status must be success)."""
        query = urllib.parse.urlencode(params, doseq=True)
        answer = _get_json(f"{self.url}/api/v1/{path}?{query}")
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result (vector or matrix), at ``at`` (Unix time) or now."""
        params: dict[str, Any] = {"query": promql}
        if at is not None:
            params["time"] = repr(at)
        result: list[dict[str, Any]] = self.api("query", **params)["result"]
        return result

    def value(self, promql: str, at: float | None = None) -> float | None:
        """The single value of an instant query; None while it has no result."""
        result = self.query(promql, at)
        if not result:
            return None
        assert len(result) == 1, result
        return float(result[0]["value"][1])

    def wait_until(self, promql: str, done: Callable[[float | None], bool]) -> float | None:
        """Poll (bounded) until ``done`` holds for the value of ``promql``."""
        deadline = time.monotonic() + WAIT_LIMIT_S
        seen = self.value(promql)
        while not done(seen):
            if time.monotonic() > deadline:
                targets = self.api("targets")
                raise AssertionError(
                    f"{promql} = {seen} after {WAIT_LIMIT_S} s\ntargets: {targets}\n{self.logs}"
                )
            time.sleep(0.1)
            seen = self.value(promql)
        return seen

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@contextmanager
def running_prometheus(targets: Sequence[str], workdir: Path) -> Iterator[Prometheus]:
    """A ready Prometheus scraping ``targets`` with the repository's config."""
    config = repo_config_for(targets, workdir)
    prometheus: Prometheus | None = None
    try:
        for _attempt in range(3):  # the free port may be taken between check and bind
            prometheus = Prometheus(config, workdir)
            try:
                prometheus.wait_ready()
                break
            except RuntimeError:
                prometheus.stop()
                if "address already in use" not in prometheus.logs:
                    raise
        else:
            raise RuntimeError("no free port for prometheus after 3 tries")
        yield prometheus
    finally:
        if prometheus is not None:
            prometheus.stop()
            assert prometheus.process.poll() is not None
