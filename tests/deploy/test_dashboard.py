"""The Grafana dashboard (deploy/grafana/dashboards/tokembed.json), checked as far as a
machine without Grafana allows: Grafana itself is never started here (no image for it can
be had). What Grafana would send to Prometheus is checked instead:

- statically: every panel queries only metrics the server exports, on job "tokembed" and
  the dashboard's `$instance`, and parses as PromQL (promtool);
- live: a real tokembed server (port 0) under known traffic, scraped by a real Prometheus
  (Debian's package, a free loopback port, its own data folder) with the repository's
  scrape config; every panel's query, its template variables filled in as Grafana fills
  them, returns data, the figures the traffic implies where they are known, and the
  labels its legend names.
"""

from __future__ import annotations

import math
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from deploy_files import (
    CONTRACT_METRICS,
    DASHBOARD,
    DEPLOY,
    PanelQuery,
    dashboard,
    dashboard_queries,
    fill_variables,
    grafana_regex_escape,
    run,
    series_names,
    server_metric_families,
)

from tokembed.v1 import embedding_pb2 as pb

from support.prometheus import JOB, Prometheus, binary, running_prometheus
from support.requests import embed_request, stub_for
from support.server import ServerThread

INSTANCE_FILTER = 'instance=~"$instance"'
# What Grafana puts in for `$instance` when "All" is selected: the variable's allValue.
ALL_INSTANCES = ".*"


def _variables(rate_interval: str, instance: str) -> dict[str, str]:
    return {"__rate_interval": rate_interval, "instance": instance}


def _selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name, matchers) of every selector in ``expr``."""
    return re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", expr)


# --- static ----------------------------------------------------------------------------


def test_dashboard_queries_only_metrics_the_server_exports() -> None:
    queries = dashboard_queries()
    contract = series_names(CONTRACT_METRICS)
    exported = series_names(server_metric_families())
    for query in queries:
        # Every metric is named in a selector (no bare names that escape the job filter).
        named = {name for name, _ in _selectors(query.expr)}
        bare = set(re.findall(r"\b((?:tokembed|process)_[a-z_]+)\b", query.expr)) - named
        assert not bare, f"{query.name}: select {sorted(bare)} with {{job=...}} matchers"
        for name, matchers in _selectors(query.expr):
            assert f'job="{JOB}"' in matchers, f"{query.name}: {name}{{{matchers}}}"
            assert INSTANCE_FILTER in matchers, f"{query.name}: {name} ignores $instance"
            if name == "up":
                continue
            assert name in exported, f"{query.name}: {name} is not a metric the server exports"
            if name.startswith("tokembed_"):
                assert name in contract, f"{query.name}: {name} is outside the metrics contract"


def test_dashboard_shows_what_operators_asked_for() -> None:
    exprs = [q.expr for q in dashboard_queries()]

    def has(pattern: str) -> bool:
        return any(re.search(pattern, e) for e in exprs)

    assert has(r"rate\(tokembed_requests_total"), "requests/s"
    for q in ("0.5", "0.99"):
        assert has(rf"histogram_quantile\({q}, .*tokembed_request_duration_seconds_bucket"), q
    assert has(r"tokembed_batch_requests_(sum|bucket)"), "batch size"
    assert has(r"rate\(tokembed_tokens_total"), "tokens/s"
    assert has(r"sum by \(reason\) \(rate\(tokembed_rejections_total"), "errors by reason"
    assert has(r"tokembed_queued_tokens"), "queue depth"


def test_dashboard_variables_are_the_ones_the_tests_fill() -> None:
    """The test fills `$instance` and `$__rate_interval`; a new variable needs a value here
    (fill_variables refuses a variable it has no value for)."""
    variables = dashboard()["templating"]["list"]
    assert [v["name"] for v in variables] == ["instance"]
    (instance,) = variables
    # Multi-value with "All": Grafana then regex-escapes a selected value and writes
    # allValue for "All", which is what _variables() is given below.
    assert instance["multi"] and instance["includeAll"]
    assert instance["allValue"] == ALL_INSTANCES
    assert _label_values(instance) == (f'up{{job="{JOB}"}}', "instance")


def _label_values(variable: dict[str, Any]) -> tuple[str, str]:
    """(series selector, label) of a `label_values(selector, label)` variable query."""
    query = variable["query"]
    text = query["query"] if isinstance(query, dict) else query
    match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", text.strip())
    assert match, f"variable {variable['name']}: not a label_values() query: {text}"
    return match.group(1), match.group(2)


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query, as a recording rule, with the variables filled in both
    ways Grafana fills them: "All", and one selected instance (regex-escaped)."""
    promtool = binary("promtool")
    rules = []
    for variant, instance in enumerate((ALL_INSTANCES, grafana_regex_escape("127.0.0.1:9464"))):
        for i, query in enumerate(dashboard_queries()):
            expr = fill_variables(query.expr, _variables("1m", instance))
            rules.append({"record": f"tokembed:dashboard_{variant}_{i}", "expr": expr})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = run([promtool, "check", "rules", str(path)])
    assert out.returncode == 0, out.stdout + out.stderr
    # The check has teeth: a query that does not parse fails it.
    path.write_text(yaml.safe_dump({"groups": [{"name": "bad", "rules": [
        {"record": "tokembed:bad", "expr": "sum(rate(tokembed_tokens_total{job=\"x\"}[1m])"}
    ]}]}))  # fmt: skip
    assert run([promtool, "check", "rules", str(path)]).returncode != 0


def test_grafana_datasource_matches_the_dashboard() -> None:
    datasources = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"]
    (ds,) = datasources
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    board = dashboard()
    assert board["uid"] == "tokembed"
    uids = {p["datasource"]["uid"] for p in board["panels"]}
    uids |= {v["datasource"]["uid"] for v in board["templating"]["list"]}
    assert uids == {ds["uid"]}


# --- live: a real server, known traffic, a real Prometheus --------------------------------

# The known traffic (the small model: V=1000, D=64).
VALID_EMBEDS, EMBED_TOKENS = 37, 8
INVALID_EMBEDS = 3  # ids outside [0, V)
STREAM_MESSAGES = 3  # EmbedStream counts one request per message (docs/metrics.md)
# + one EmbedChunked, one GetModelInfo
REQUESTS = VALID_EMBEDS + INVALID_EMBEDS + STREAM_MESSAGES + 1 + 1
CALLED_METHODS = {"Embed", "EmbedStream", "EmbedChunked", "GetModelInfo"}


def _send_known_traffic(target: str) -> None:
    """Every method of the service, and failures, so that every panel has something."""
    with stub_for(target) as stub:
        for k in range(VALID_EMBEDS):
            stub.Embed(embed_request([[(k + j) % 1000 for j in range(EMBED_TOKENS)]]), timeout=10)
        for bad in ([[1000]], [[-1, 2]], [[3, 4, 5000]]):
            with pytest.raises(grpc.RpcError) as error:
                stub.Embed(embed_request(bad), timeout=10)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stream = iter([embed_request([[1, 2, 3, 4]])] * STREAM_MESSAGES)
        answers = list(stub.EmbedStream(stream, timeout=10))
        assert len(answers) == STREAM_MESSAGES and all(a.HasField("response") for a in answers)
        assert list(stub.EmbedChunked(embed_request([[5, 6, 7, 8], [9, 10, 11, 12]]), timeout=10))
        stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)


@dataclass
class Scraped:
    """A Prometheus that has scraped the server after the known traffic."""

    prometheus: Prometheus
    server: ServerThread
    instance: str  # the target's instance label
    at: float  # the time of a scrape after all the traffic: queries are evaluated there
    window_s: int  # a range that reaches back past the first scrape

    def run(self, query: PanelQuery, instance: str) -> list[dict[str, Any]]:
        """The query as Grafana would send it, with `$instance` as given."""
        expr = fill_variables(query.expr, _variables(f"{self.window_s}s", instance))
        return self.prometheus.query(expr, at=self.at)

    def server_total(self, name: str) -> float:
        """The sum of every sample ``name`` in the server's own registry."""
        return self.server.metric(name)


@pytest.fixture(scope="module")
def scraped(small_model_dir: Path) -> Iterator[Scraped]:
    binary("prometheus")
    from tokembed.server.process.settings import Settings

    settings = Settings(model_dir=small_model_dir, port=0, metrics_port=0).validate()
    server = ServerThread(settings).start()
    try:
        with tempfile.TemporaryDirectory(prefix="tokembed-dashboard-") as workdir:
            instance = f"127.0.0.1:{server.metrics_port}"
            with running_prometheus([instance], Path(workdir)) as prometheus:
                requests = f'sum(tokembed_requests_total{{job="{JOB}"}})'
                # Up, and the counters scraped at 0 before any traffic: a rate over the
                # run then counts all of it (Prometheus extrapolates neither end).
                prometheus.wait_until(f'up{{job="{JOB}"}}', lambda v: v == 1)
                prometheus.wait_until(requests, lambda v: v == 0)
                _send_known_traffic(server.target)
                # Then a scrape that counts every request (the server may count one a
                # moment after its caller has the answer): all the traffic, which the
                # server's own registry holds too from then on.
                prometheus.wait_until(requests, lambda v: v == REQUESTS)
                assert server.metric("tokembed_requests_total") == REQUESTS
                recent = prometheus.query(f'tokembed_requests_total{{job="{JOB}"}}[1m]')
                at = max(float(series["values"][-1][0]) for series in recent)
                window_s = math.ceil(at - prometheus.started_at) + 60
                yield Scraped(prometheus, server, instance, at, window_s)
    finally:
        server.stop()


def _finite(result: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in result if math.isfinite(float(r["value"][1]))]


@pytest.mark.parametrize("query", dashboard_queries(), ids=lambda q: f"{q.panel}-{q.ref_id}")
def test_panel_returns_data_after_known_traffic(scraped: Scraped, query: PanelQuery) -> None:
    every = scraped.run(query, ALL_INSTANCES)
    assert every, f"{query.name} returns no data: {query.expr}"
    # NaN only where there is nothing to compute from: a quantile of a method not called.
    for series in every:
        value = float(series["value"][1])
        method = series["metric"].get("method")
        assert math.isfinite(value) or method not in CALLED_METHODS, (query.name, series)
    assert _finite(every), f"{query.name}: no finite value in {every}"
    # The legend's {{label}}s are labels of the series it names.
    for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", query.legend):
        assert all(label in s["metric"] for s in every), f"{query.name}: no {label} in {every}"
    # Selecting this one instance gives the same answer; an instance that is not scraped,
    # none: the panel follows `$instance`.
    one = scraped.run(query, grafana_regex_escape(scraped.instance))
    assert _by_labels(one) == _by_labels(every), query.name
    assert scraped.run(query, grafana_regex_escape("127.0.0.1:1")) == [], query.name


def _by_labels(result: list[dict[str, Any]]) -> dict[tuple[tuple[str, str], ...], str]:
    return {tuple(sorted(r["metric"].items())): r["value"][1] for r in result}


def _panel(title: str, legend: str) -> PanelQuery:
    found = [q for q in dashboard_queries() if q.panel == title and q.legend == legend]
    assert len(found) == 1, f"no single query {legend!r} in a panel {title!r} of {DASHBOARD}"
    return found[0]


Check = Callable[[Scraped], list[tuple[dict[str, str], float]]]

# The figures the known traffic implies: (panel title, legend) -> [(series labels, value)].
# A rate over the whole run, evaluated at a scrape after it, is the count over the window.
KNOWN: dict[tuple[str, str], Check] = {
    ("Requests per second", "{{method}} {{code}}"): lambda s: [
        ({"method": "Embed", "code": "OK"}, VALID_EMBEDS / s.window_s),
        ({"method": "Embed", "code": "INVALID_ARGUMENT"}, INVALID_EMBEDS / s.window_s),
        ({"method": "GetModelInfo", "code": "OK"}, 1 / s.window_s),
    ],
    ("Errors by reason", "{{reason}}"): lambda s: [
        ({"reason": "invalid_input"}, INVALID_EMBEDS / s.window_s),
        ({"reason": "overloaded"}, 0.0),
    ],
    ("Error ratio", "error ratio"): lambda s: [
        ({}, INVALID_EMBEDS / REQUESTS),
    ],
    ("Tokens per second", "tokens/s"): lambda s: [
        ({}, s.server_total("tokembed_tokens_total") / s.window_s),
    ],
    ("Output bytes per second", "output"): lambda s: [
        ({}, s.server_total("tokembed_output_bytes_total") / s.window_s),
    ],
    ("Batch size", "batches/s"): lambda s: [
        ({}, s.server_total("tokembed_batches_total") / s.window_s),
    ],
    ("Queue depth", "queued tokens"): lambda s: [({}, 0.0)],
    ("Queue depth", "in-flight requests"): lambda s: [({}, 0.0)],
    ("Targets up", "up"): lambda s: [({}, 1.0)],
}


@pytest.mark.parametrize("key", list(KNOWN), ids=lambda k: f"{k[0]}-{k[1]}")
def test_panel_shows_the_figures_of_the_known_traffic(
    scraped: Scraped, key: tuple[str, str]
) -> None:
    query = _panel(*key)
    got = {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in
           scraped.run(query, ALL_INSTANCES)}  # fmt: skip
    for labels, want in KNOWN[key](scraped):
        wanted = tuple(sorted(labels.items()))
        assert wanted in got, f"{query.name}: no series {labels} in {got}"
        assert got[wanted] == pytest.approx(want, rel=1e-9, abs=1e-12), (query.name, labels)


def test_model_panel_names_the_served_model(scraped: Scraped) -> None:
    (query,) = [q for q in dashboard_queries() if q.panel == "Model"]
    (series,) = scraped.run(query, ALL_INSTANCES)
    labels = series["metric"]
    assert float(series["value"][1]) == 1
    assert (labels["name"], labels["vocab_size"], labels["d_model"]) == ("small", "1000", "64")
    assert labels["instance"] == scraped.instance


def test_instance_variable_lists_the_scraped_server(scraped: Scraped) -> None:
    """`label_values(up{job="tokembed"}, instance)`, as Grafana asks Prometheus for it."""
    (variable,) = dashboard()["templating"]["list"]
    selector, label = _label_values(variable)
    values = scraped.prometheus.api(f"label/{label}/values", **{"match[]": selector})
    assert values == [scraped.instance]
