"""A real Prometheus: promtool lints a live scrape, and a Prometheus server, configured with
the repository's own scrape config, scrapes a server under known traffic.

Debian's ``prometheus`` package provides both binaries (``.ci/run`` installs it); without
them these tests skip. Everything runs on loopback, on free ports, in temporary folders
that are removed afterwards, and the Prometheus process is ended even when a test fails.
"""

from __future__ import annotations

import math
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from tokembed.v1 import embedding_pb2 as pb

from support.metrics import scrape
from support.prometheus import JOB, REPO_CONFIG, Prometheus, binary, running_prometheus
from support.requests import embed_request, ids_of, stub_for
from support.server import ServerThread

ROOT = Path(__file__).resolve().parents[2]
METRICS_DOC = ROOT / "docs" / "metrics.md"

# The three queries docs/metrics.md gives users, run here against real data.
P99_LATENCY = (
    "histogram_quantile(0.99, "
    'sum by (le) (rate(tokembed_request_duration_seconds_bucket{method="Embed"}[5m])))'
)
TOKENS_PER_SECOND = "sum(rate(tokembed_tokens_total[5m]))"
ERROR_RATIO = (
    'sum(rate(tokembed_requests_total{code!="OK"}[5m])) / sum(rate(tokembed_requests_total[5m]))'
)


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
    promtool = binary("promtool")
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


# --- a Prometheus server (tests/support/prometheus.py) ----------------------------------


@pytest.fixture
def prometheus_workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="tokembed-prometheus-") as name:
        yield Path(name)
    assert not Path(name).exists()


def test_prometheus_scrapes_the_server_with_the_repository_config(
    prometheus_workdir: Path,
    small_model_dir: Path,
    start_server: Callable[..., ServerThread],
) -> None:
    assert REPO_CONFIG.is_file(), f"{REPO_CONFIG} is missing"
    server = start_server(small_model_dir)
    with running_prometheus([f"127.0.0.1:{server.metrics_port}"], prometheus_workdir) as p:
        _scrapes_and_answers_the_documented_queries(p, server)


def _scrapes_and_answers_the_documented_queries(
    prometheus: Prometheus, server: ServerThread
) -> None:
    # Each model's series, and model="" for requests that name no served model.
    ok = f'tokembed_requests_total{{job="{JOB}",method="Embed",code="OK",model="small"}}'
    invalid = (
        f'tokembed_requests_total{{job="{JOB}",method="Embed",code="INVALID_ARGUMENT",'
        'model="small"}'
    )
    # Up, and the counters scraped at 0 before any traffic.
    prometheus.wait_until(f'up{{job="{JOB}"}}', lambda seen: seen == 1)
    prometheus.wait_until(ok, lambda seen: seen == 0)
    prometheus.wait_until(invalid, lambda seen: seen == 0)

    _send_known_traffic(server.target)
    prometheus.wait_until(ok, lambda seen: seen == 37)
    prometheus.wait_until(invalid, lambda seen: seen == 3)

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
