"""The metric set: every metric issue 4 names, with its type, labels and buckets, on a
registry of its own, served on the metrics port of a real server."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry

from tokembed.server.core import errors
from tokembed.server.edge.status_codes import STATUS_BY_ERROR
from tokembed.server.edge.v1.servicer import FRONT_END
from tokembed.server.observability.metrics import REJECTION_REASONS, Metrics
from tokembed.server.observability.model_metrics import ModelLabels
from tokembed.v1 import embedding_pb2 as pb

from support.metrics import families, matching, scrape
from support.requests import embed_request, ids_of, stub_for
from support.server import ServerThread

LATENCY_HISTOGRAMS = (
    "tokembed_request_duration_seconds",  # total server time of an RPC
    "tokembed_queue_wait_seconds",
    "tokembed_compute_seconds",  # the look-up
    "tokembed_encode_seconds",  # the response's encoding
)
# {family as the text format names it: (type, label names)}
EXPECTED = {
    "tokembed_requests": (
        "counter",
        {"protocol", "operation", "method", "code", "model", "version"},
    ),
    "tokembed_request_duration_seconds": (
        "histogram",
        {"protocol", "operation", "method", "model", "version"},
    ),
    "tokembed_queue_wait_seconds": ("histogram", {"model"}),
    "tokembed_compute_seconds": ("histogram", {"model"}),
    "tokembed_encode_seconds": ("histogram", {"model"}),
    "tokembed_batch_requests": ("histogram", {"model"}),
    "tokembed_batch_tokens": ("histogram", {"model"}),
    "tokembed_batches": ("counter", {"model"}),
    "tokembed_tokens": ("counter", {"model"}),
    "tokembed_output_bytes": ("counter", {"model"}),
    "tokembed_inflight_requests": ("gauge", set()),
    "tokembed_inflight_output_bytes": ("gauge", set()),
    "tokembed_queued_tokens": ("gauge", {"model"}),
    "tokembed_rejections": ("counter", {"reason"}),
    "tokembed_model_info": (
        "gauge",
        {"name", "version", "vocab_size", "d_model", "dtype", "execution_provider", "backend"},
    ),
    "tokembed_ready": ("gauge", set()),
    "tokembed_model_state": ("gauge", {"model", "version", "state"}),
    "tokembed_model_loads": ("counter", {"model", "version", "outcome"}),
    "tokembed_model_load_duration_seconds": ("histogram", {"model", "outcome"}),
    "tokembed_model_unloads": ("counter", {"model", "version", "outcome"}),
    "tokembed_model_unload_duration_seconds": ("histogram", {"model", "outcome"}),
    "process_cpu_seconds": ("counter", set()),
    "process_resident_memory_bytes": ("gauge", set()),
    "process_open_fds": ("gauge", set()),
}
ISSUE_REASONS = {"overloaded", "invalid_input", "too_large", "deadline_exceeded", "cancelled"}


def _label_names(family: prometheus_client.Metric) -> set[str]:
    names: set[str] = set()
    for sample in family.samples:
        names |= set(sample.labels) - {"le"}
    return names


def test_a_live_scrape_has_every_metric_with_its_type_and_labels(
    small_model_dir: Path, start_server: Callable[..., ServerThread]
) -> None:
    server = start_server(small_model_dir)
    with stub_for(server.target) as stub:
        stub.Embed(embed_request(ids_of(8)), timeout=10)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    found = families(scrape(server.metrics_port))

    for name, (kind, labels) in EXPECTED.items():
        assert name in found, f"{name} missing from the scrape"
        assert found[name].type == kind, name
        assert _label_names(found[name]) == labels, name
    for name, family in found.items():
        if not name.startswith(("process_", "python_")):
            assert name.startswith("tokembed_"), name
        assert family.documentation.strip(), f"{name} has no help text"

    # Model info: one series, value 1, labelled with what GetModelInfo reports.
    (model,) = found["tokembed_model_info"].samples
    assert model.value == 1
    assert model.labels == {
        "name": info.name,
        "version": info.version,
        "vocab_size": str(info.vocab_size),
        "d_model": str(info.d_model),
        "dtype": info.weight_dtype,
        "execution_provider": info.execution_provider,
        "backend": info.backend,
    }
    assert model.labels["backend"] == "table"
    assert model.labels["name"] == "small" and model.labels["vocab_size"] == "1000"
    assert model.labels["execution_provider"] == "CPUExecutionProvider"

    # The process collectors measure this process (the server runs in the test's process).
    values = {s.name: s.value for f in found.values() for s in f.samples if not s.labels}
    assert values["process_cpu_seconds_total"] > 0
    assert values["process_resident_memory_bytes"] > 10 * 2**20
    assert 0 < values["process_open_fds"] <= values["process_max_fds"]


def _with_a_model(registry: CollectorRegistry, name: str = "small") -> Metrics:
    """Metrics wired as the server wires them: its front end, one model, what is served."""
    metrics = Metrics(registry)
    metrics.add_front_end(FRONT_END)
    metrics.add_model(name)
    labels = ModelLabels(name, "1", 1000, 64, "float32", "CPUExecutionProvider", "table")
    metrics.track_models(lambda: [(labels, 0)], lambda: True)
    return metrics


def test_latency_histograms_resolve_below_a_millisecond() -> None:
    registry = CollectorRegistry()
    _with_a_model(registry)
    for name in LATENCY_HISTOGRAMS:
        bounds = sorted(float(s.labels["le"]) for s in matching(registry, f"{name}_bucket"))
        assert bounds, name
        assert bounds[0] <= 0.0001, f"{name}: first bucket {bounds[0]} s"
        assert len([b for b in bounds if b < 0.001]) >= 3, f"{name}: {bounds}"
        assert max(b for b in bounds if b != float("inf")) >= 5, f"{name}: {bounds}"


# How each method's calls can end, by whether they reached a model ("" : refused before
# routing, or a listing, which names none): the series that start at 0, and no others (a
# series that can never move is noise on a dashboard).
_EMBED_CODES = {
    "": {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "NOT_FOUND", "UNAVAILABLE", "UNAUTHENTICATED"},
    "model": {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED",
              "UNAVAILABLE", "INTERNAL"},
}  # fmt: skip
CODES_BY_METHOD = {
    "Embed": _EMBED_CODES,
    "EmbedStream": _EMBED_CODES,
    "EmbedChunked": _EMBED_CODES,
    "Nearest": _EMBED_CODES,
    "NearestChunked": _EMBED_CODES,
    "Tokenize": _EMBED_CODES,
    "Detokenize": _EMBED_CODES,
    "EmbedText": _EMBED_CODES,
    "EmbedTextChunked": _EMBED_CODES,
    "GetModelInfo": {"": {"INVALID_ARGUMENT", "NOT_FOUND", "UNAVAILABLE", "UNAUTHENTICATED"},
                     "model": {"OK"}},
    "ListModels": {"": {"OK", "INVALID_ARGUMENT", "UNAVAILABLE", "UNAUTHENTICATED"},
                   "model": set()},
}  # fmt: skip


def test_reasons_methods_and_codes_exist_at_zero_before_any_request() -> None:
    """Series born at 0, so increase() and rate() count the first event after a start
    (the Prometheus test shows it: a series born at 3 would show no increase)."""
    registry = CollectorRegistry()
    metrics = _with_a_model(registry, "enc")
    assert set(REJECTION_REASONS) >= ISSUE_REASONS
    for reason in REJECTION_REASONS:
        assert registry.get_sample_value("tokembed_rejections_total", {"reason": reason}) == 0
    # Every way a call of each method can end, for each model served and for calls that
    # reached none (""); a model added once serving ("dec") starts its series too. Between
    # them, every code the server answers with.
    assert set(FRONT_END.methods) == set(CODES_BY_METHOD)
    every_code = {code for codes in CODES_BY_METHOD.values() for each in codes.values()
                  for code in each}  # fmt: skip
    # The control methods' errors (load, unload: no counted call ends with them) aside.
    control = {errors.ControlRefused, errors.LoadFailed}
    data_codes = {code.name for error, code in STATUS_BY_ERROR.items() if error not in control}
    assert every_code == {"OK"} | data_codes
    metrics.add_model("dec")
    want = {
        (method, code, model)
        for method, codes in CODES_BY_METHOD.items()
        for model in ("enc", "dec", "")
        for code in codes["model" if model else ""]
    }
    got = {}
    for sample in matching(registry, "tokembed_requests_total"):
        labels = sample.labels
        assert labels["protocol"] == "tokembed.v1", labels
        assert labels["operation"] == FRONT_END.methods[labels["method"]], labels
        got[(labels["method"], labels["code"], labels["model"])] = sample.value
    assert set(got) == want
    assert set(got.values()) == {0}
    for method, model in {(method, model) for method, _, model in want}:
        call = {"protocol": "tokembed.v1", "operation": FRONT_END.methods[method]}
        labels = {**call, "method": method, "model": model, "version": ""}
        assert registry.get_sample_value("tokembed_request_duration_seconds_count", labels) == 0
    for model in ("enc", "dec"):
        for family_name in (
            "tokembed_tokens_total",
            "tokembed_batches_total",
            "tokembed_output_bytes_total",
        ):
            assert registry.get_sample_value(family_name, {"model": model}) == 0, (
                family_name, model,
            )  # fmt: skip


def test_nothing_is_registered_globally(
    small_model_dir: Path, start_server: Callable[..., ServerThread]
) -> None:
    """Two servers in one process count apart, and the global registry holds neither."""
    first = start_server(small_model_dir)
    second = start_server(small_model_dir)
    with stub_for(first.target) as stub:
        for _ in range(3):
            stub.Embed(embed_request(ids_of(8)), timeout=10)
    ok = {"method": "Embed", "code": "OK"}
    assert first.metric("tokembed_requests_total", ok) == 3
    assert second.metric("tokembed_requests_total", ok) == 0
    assert "tokembed_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    # Metrics can be built any number of times, each on its own registry.
    for _ in range(2):
        Metrics(CollectorRegistry())


@pytest.mark.parametrize("document", ["docs/metrics.md", "README.md"])
def test_the_docs_describe_every_metric_with_its_type_and_labels(document: str) -> None:
    """docs/metrics.md and the README have a table row for each metric the server registers."""
    doc = (Path(__file__).resolve().parents[2] / document).read_text()
    rows = [line.split(" | ") for line in doc.splitlines() if line.startswith("| `")]
    registry = CollectorRegistry()
    _with_a_model(registry)
    for family in registry.collect():
        name = f"{family.name}_total" if family.type == "counter" else family.name
        (row,) = [row for row in rows if f"`{name}`" in row[0]] or [None]
        assert row is not None, f"{document} does not describe {name}"
        assert row[1] == family.type, f"{name}: documented as {row[1]}"
        labels = _label_names(family)
        documented = set(re.findall(r"`([a-z_]+)`", row[2]))
        assert labels <= documented, f"{name}: labels {labels} documented as {documented}"
