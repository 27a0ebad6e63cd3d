"""A real Prometheus: promtool lints a live scrape, and a Prometheus server, configured with
the repository's own scrape config, scrapes a server under known traffic.

Debian's ``prometheus`` package provides both binaries (``.ci/run`` installs it); without
them these tests skip. Everything runs on loopback, on free ports, in temporary folders
that are removed afterwards, and the Prometheus process is ended even when a test fails.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from metrics_helpers import embed_request, ids_of, scrape, stub_for

from tokembed.v1 import embedding_pb2 as pb

from support.server import ServerThread

ROOT = Path(__file__).resolve().parents[2]
REPO_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
METRICS_DOC = ROOT / "docs" / "metrics.md"
JOB = "tokembed"
SCRAPE_INTERVAL = "250ms"
POLL_LIMIT_S = 60.0

# The three queries docs/metrics.md gives users, run here against real data.
P99_LATENCY = (
    "histogram_quantile(0.99, "
    'sum by (le) (rate(tokembed_request_duration_seconds_bucket{method="Embed"}[5m])))'
)
TOKENS_PER_SECOND = "sum(rate(tokembed_tokens_total[5m]))"
ERROR_RATIO = (
    'sum(rate(tokembed_requests_total{code!="OK"}[5m])) / sum(rate(tokembed_requests_total[5m]))'
)


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (CI installs Debian's prometheus package)")
    return path


def _send_known_traffic(target: str) -> None:
    """37 valid Embed requests of 8 tokens, 3 invalid ones (ids outside [0, 1000))."""
    with stub_for(target) as stub:
        for k in range(37):
            stub.Embed(embed_request(ids_of(8, start=k)), timeout=10)
        for bad in ([[1000]], [[-1, 2]], [[3, 4, 5000]]):
            with pytest.raises(grpc.RpcError):
                stub.Embed(embed_request(bad), timeout=10)


# --- promtool --------------------------------------------------------------------------


def test_a_scrape_under_traffic_passes_promtool_check_metrics(
    small_model_dir: Path, start_server: Callable[..., ServerThread]
) -> None:
    promtool = _binary("promtool")
    server = start_server(small_model_dir, max_tokens_per_request=64)
    # Traffic through every method and several failures, so every family has samples.
    _send_known_traffic(server.target)
    with stub_for(server.target) as stub:
        list(stub.EmbedStream(iter([embed_request(ids_of(4))] * 3), timeout=10))
        list(stub.EmbedChunked(embed_request(ids_of(4, batch=2)), timeout=10))
        stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        with pytest.raises(grpc.RpcError):
            stub.Embed(embed_request(ids_of(65)), timeout=10)  # too large
    text = scrape(server.metrics_port)
    assert "tokembed_requests_total" in text and "process_open_fds" in text

    checked = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert (checked.returncode, checked.stdout, checked.stderr) == (0, "", ""), checked
    # The lint has teeth: a counter without `_total` is a problem to promtool.
    bad = "# HELP demo_requests Requests.\n# TYPE demo_requests counter\ndemo_requests 1\n"
    flagged = subprocess.run(
        [promtool, "check", "metrics"], input=bad, capture_output=True, text=True, timeout=60
    )
    assert flagged.returncode != 0 and "_total" in flagged.stdout + flagged.stderr


# --- a Prometheus server ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


class Prometheus:
    """A Prometheus server on a free loopback port, its storage in ``workdir``."""

    def __init__(self, binary: str, config: Path, workdir: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

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

    @property
    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": promql}
        if at is not None:
            params["time"] = repr(at)
        answer = _get_json(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}")
        assert answer["status"] == "success", answer
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def value(self, promql: str, at: float | None = None) -> float | None:
        """The single value of an instant query; None while it has no result."""
        result = self.query(promql, at)
        if not result:
            return None
        assert len(result) == 1, result
        return float(result[0]["value"][1])

    def poll(self, promql: str, want: float) -> None:
        """Wait (bounded) until ``promql`` evaluates to ``want``."""
        deadline = time.monotonic() + POLL_LIMIT_S
        seen: float | None = None
        while time.monotonic() < deadline:
            seen = self.value(promql)
            if seen == want:
                return
            time.sleep(0.1)
        raise AssertionError(
            f"{promql} = {seen} after {POLL_LIMIT_S} s, want {want}\n"
            f"targets: {_get_json(self.url + '/api/v1/targets')}\n{self.logs}"
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def _config_for(target: str, workdir: Path) -> Path:
    """The repository's scrape config, pointed at ``target``, scraping every 250 ms.

    Only the intervals and where the targets are change; the job, its path, scheme and
    relabelling are the repository's. The repository keeps targets apart (file_sd files
    beside the config, or static_configs); here they name only the test's server.
    """
    config = yaml.safe_load(REPO_CONFIG.read_text())
    config.setdefault("global", {}).update(
        scrape_interval=SCRAPE_INTERVAL, scrape_timeout=SCRAPE_INTERVAL, evaluation_interval="1s"
    )
    jobs = [job for job in config["scrape_configs"] if job["job_name"] == JOB]
    assert len(jobs) == 1, f"{REPO_CONFIG} has no single job {JOB!r}"
    job = jobs[0]
    job.pop("scrape_interval", None)
    job.pop("scrape_timeout", None)
    targets = [{"targets": [target]}]
    assert "static_configs" in job or "file_sd_configs" in job, job
    if "static_configs" in job:
        job["static_configs"] = targets
    for file_sd in job.get("file_sd_configs", []):
        for pattern in file_sd["files"]:
            # A file the pattern matches (relative patterns are relative to the config).
            name = Path(pattern.replace("*", "tokembed-test"))
            path = name if name.is_absolute() else workdir / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump(targets))
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture
def prometheus_workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="tokembed-prometheus-") as name:
        yield Path(name)
    assert not Path(name).exists()


@pytest.fixture
def run_prometheus(prometheus_workdir: Path) -> Iterator[Callable[[str], Prometheus]]:
    binary = _binary("prometheus")
    started: list[Prometheus] = []

    def run(target: str) -> Prometheus:
        config = _config_for(target, prometheus_workdir)
        for _attempt in range(3):  # the free port may be taken between check and bind
            prometheus = Prometheus(binary, config, prometheus_workdir)
            started.append(prometheus)
            try:
                prometheus.wait_ready()
                return prometheus
            except RuntimeError:
                prometheus.stop()
                if "address already in use" not in prometheus.logs:
                    raise
        raise RuntimeError("no free port for prometheus after 3 tries")

    yield run
    for prometheus in started:
        prometheus.stop()
    assert all(prometheus.process.poll() is not None for prometheus in started)


def test_prometheus_scrapes_the_server_with_the_repository_config(
    run_prometheus: Callable[[str], Prometheus],
    small_model_dir: Path,
    start_server: Callable[..., ServerThread],
) -> None:
    assert REPO_CONFIG.is_file(), f"{REPO_CONFIG} is missing"
    server = start_server(small_model_dir)
    prometheus = run_prometheus(f"127.0.0.1:{server.metrics_port}")

    # Each model's series, and model="" for requests that name no served model.
    ok = f'tokembed_requests_total{{job="{JOB}",method="Embed",code="OK",model="small"}}'
    invalid = (
        f'tokembed_requests_total{{job="{JOB}",method="Embed",code="INVALID_ARGUMENT",'
        'model="small"}'
    )
    # Up, and the counters scraped at 0 before any traffic.
    prometheus.poll(f'up{{job="{JOB}"}}', 1)
    prometheus.poll(ok, 0)
    prometheus.poll(invalid, 0)

    _send_known_traffic(server.target)
    prometheus.poll(ok, 37)
    prometheus.poll(invalid, 3)

    # increase() over the whole run, evaluated at the last scrape: Prometheus extrapolates
    # neither end then (the series start at 0 and end at that scrape), so it is exact.
    (series,) = prometheus.query(f"{ok}[5m]")
    last_scrape = float(series["values"][-1][0])
    assert float(series["values"][0][1]) == 0

    def increase(selector: str) -> float | None:
        return prometheus.value(f"sum(increase({selector}[5m]))", at=last_scrape)

    assert increase(ok) == 37
    assert increase(invalid) == 3
    assert increase(f'tokembed_requests_total{{job="{JOB}"}}') == 40
    assert increase(f'tokembed_rejections_total{{job="{JOB}",reason="invalid_input"}}') == 3
    assert increase(f'tokembed_tokens_total{{job="{JOB}"}}') == 296
    assert increase(f'tokembed_batches_total{{job="{JOB}"}}') == 37
    assert increase(f'tokembed_queue_wait_seconds_count{{job="{JOB}"}}') == 37
    assert prometheus.value(f'tokembed_model_info{{job="{JOB}",name="small"}}') == 1
    assert increase(f'tokembed_requests_total{{job="{JOB}",model=""}}') == 0

    # The documented queries give the traffic's figures.
    for document in (METRICS_DOC, ROOT / "README.md"):
        for promql in (P99_LATENCY, TOKENS_PER_SECOND, ERROR_RATIO):
            assert promql in document.read_text(), f"{document.name} no longer shows {promql}"
    p99 = prometheus.value(P99_LATENCY, at=last_scrape)
    assert p99 is not None and 0 < p99 < 1, p99
    assert prometheus.value(TOKENS_PER_SECOND, at=last_scrape) == pytest.approx(296 / 300)
    assert prometheus.value(ERROR_RATIO, at=last_scrape) == pytest.approx(3 / 40)
    assert not math.isnan(p99)
