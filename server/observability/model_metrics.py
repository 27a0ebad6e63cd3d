"""The series that describe what is served, read from the repository at each scrape
(models come and go): ``tokembed_model_info``, ``tokembed_queued_tokens`` and
``tokembed_ready``. docs/metrics.md documents them with the rest (server/observability/metrics.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from tokembed.server.core.control import IndexEntry


@dataclass(frozen=True)
class ModelLabels:
    """A served model version, as ``tokembed_model_info`` labels it."""

    name: str
    version: str
    vocab_size: int
    d_model: int
    dtype: str
    execution_provider: str
    backend: str


class ModelsCollector(Collector):
    """The series that describe what is served, read from the repository at each scrape
    (models come and go): ``tokembed_model_info``, ``tokembed_queued_tokens`` and
    ``tokembed_ready``."""

    def __init__(
        self,
        models: Callable[[], list[tuple[ModelLabels, int]]],
        ready: Callable[[], bool],
    ) -> None:
        self._models = models
        self._ready = ready

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "tokembed_model_info", "A served model version (value 1)", labels=_INFO_LABELS
        )
        queued = GaugeMetricFamily(
            "tokembed_queued_tokens", "Tokens waiting in a model's batcher for a batch",
            labels=["model"],
        )  # fmt: skip
        tokens_by_model: dict[str, int] = {}
        for labels, queued_tokens in self._models():
            info.add_metric(
                [labels.name, labels.version, str(labels.vocab_size), str(labels.d_model),
                 labels.dtype, labels.execution_provider, labels.backend],
                1.0,
            )  # fmt: skip
            tokens_by_model[labels.name] = tokens_by_model.get(labels.name, 0) + queued_tokens
        for name, tokens in tokens_by_model.items():
            queued.add_metric([name], float(tokens))
        ready = GaugeMetricFamily(
            "tokembed_ready",
            "1 when every model is loaded and warmed and the server is not draining",
            value=1.0 if self._ready() else 0.0,
        )
        return iter([info, queued, ready])

    def describe(self) -> Iterator[Metric]:
        return iter([
            GaugeMetricFamily("tokembed_model_info", "", labels=_INFO_LABELS),
            GaugeMetricFamily("tokembed_queued_tokens", "", labels=["model"]),
            GaugeMetricFamily("tokembed_ready", ""),
        ])  # fmt: skip


class ModelStatesCollector(Collector):
    """``tokembed_model_state``: each model version of the repository (and each served),
    1 for the state it is in (UNAVAILABLE, LOADING, READY, UNLOADING), read from the
    control plane's index at each scrape."""

    def __init__(self, index: Callable[[], list[IndexEntry]]) -> None:
        self._index = index

    def collect(self) -> Iterator[Metric]:
        states = GaugeMetricFamily(
            "tokembed_model_state",
            "A model version's state (value 1): UNAVAILABLE, LOADING, READY or UNLOADING",
            labels=_STATE_LABELS,
        )
        for entry in self._index():
            states.add_metric([entry.name, entry.version, entry.state], 1.0)
        return iter([states])

    def describe(self) -> Iterator[Metric]:
        return iter([GaugeMetricFamily("tokembed_model_state", "", labels=_STATE_LABELS)])


_STATE_LABELS = ["model", "version", "state"]
_INFO_LABELS = ["name", "version", "vocab_size", "d_model", "dtype", "execution_provider",
                "backend"]  # fmt: skip
