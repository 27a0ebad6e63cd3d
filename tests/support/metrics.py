"""Reading a server's metrics: a scrape of ``/metrics`` over HTTP, as Prometheus gets it, or
the registry of a server running in the test's process (``ServerThread.registry``).

Both read the same way: prometheus_client's own parser turns a scrape into the families a
registry holds, and a sample is matched by its name and the labels it must include, by
label name (so neither the labels' order nor labels a test does not name matter):

    total(scrape(server.metrics_port), "tokembed_requests_total", {"code": "OK"})
    total(server.registry, "tokembed_queued_tokens")
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

Source = str | CollectorRegistry  # a scrape's text, or a registry read in place


def scrape(metrics_port: int, *, host: str = "127.0.0.1", timeout_s: float = 10) -> str:
    """GET /metrics as Prometheus would (the status must be 200); ``host`` is a loopback
    address (a test reaches nothing else)."""
    assert host.startswith("127."), "tests talk to loopback only"
    with urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=timeout_s) as r:
        assert r.status == 200
        return str(r.read().decode("utf-8"))


def families(source: Source) -> dict[str, Metric]:
    """{family name: family}: counters without their ``_total``, as both the text format's
    ``# TYPE`` line and the registry name them."""
    found = text_string_to_metric_families(source) if isinstance(source, str) else source.collect()
    return {family.name: family for family in found}


def samples(source: Source) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, its labels sorted by name): value}: each series by its exact labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): float(sample.value)
        for family in families(source).values()
        for sample in family.samples
    }


def matching(source: Source, name: str, labels: Mapping[str, str] | None = None) -> list[Sample]:
    """The samples ``name`` (``tokembed_requests_total``, ``..._bucket``) whose labels
    include ``labels``."""
    wanted = (labels or {}).items()
    return [
        sample
        for family in families(source).values()
        for sample in family.samples
        if sample.name == name and wanted <= sample.labels.items()
    ]


def total(source: Source, name: str, labels: Mapping[str, str] | None = None) -> float:
    """The sum of the samples :func:`matching` finds (0 when there are none): with several
    models served, over every model unless ``labels`` names one."""
    return float(sum(sample.value for sample in matching(source, name, labels)))


def value(source: Source, name: str, labels: Mapping[str, str] | None = None) -> float:
    """The value of the one sample :func:`matching` finds; fails when there is none, or
    more than one."""
    found = matching(source, name, labels)
    assert len(found) == 1, f"{len(found)} samples {name} with labels {labels}: {found}"
    return float(found[0].value)


def workers_ready(metrics_base: int, workers: int) -> bool:
    """Whether each of ``--workers`` processes, whose metrics ports are ``metrics_base``
    and up, says it is ready (False while one does not answer yet)."""
    try:
        return all(total(scrape(metrics_base + i), "tokembed_ready") == 1 for i in range(workers))
    except OSError:
        return False
