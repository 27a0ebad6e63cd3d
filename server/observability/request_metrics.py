"""The counters and histograms every request updates, kept as plain numbers.

Why not prometheus_client's own: its ``Histogram.observe`` walks the bucket list in
Python and takes a lock per bucket and per sum, and a tiny request makes ten updates;
applied in bulk (``metrics.PendingUpdates``) they still cost a large part of a tiny
request's handler, measured live. Here an observation is one ``bisect`` and two
additions.

These series are only ever changed by ``PendingUpdates.apply``, which holds the lock
that :class:`RequestMetricsCollector` holds while it reads them: a scrape sees every
update made before it, none twice, and never half of one. The exposition is the one
prometheus_client writes for its own counters and histograms (names, ``le`` labels,
but no ``_created`` series: a timestamp per series that no dashboard here reads, and as
many series again on every scrape), so dashboards and docs/metrics.md do not change.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

SeriesT = TypeVar("SeriesT", "CounterSeries", "HistogramSeries")


class CounterSeries:
    """One labelled series of a counter."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float) -> None:
        self.value += amount


class HistogramSeries:
    """One labelled series of a histogram: a count per bucket (the last one +Inf)."""

    __slots__ = ("_upper_bounds", "counts", "sum")

    def __init__(self, upper_bounds: Sequence[float]) -> None:
        self._upper_bounds = tuple(upper_bounds)
        self.counts = [0] * (len(self._upper_bounds) + 1)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        # The first bucket whose bound is >= amount: Prometheus buckets are "le".
        self.counts[bisect.bisect_left(self._upper_bounds, amount)] += 1
        self.sum += amount


class _Family(Generic[SeriesT]):
    """A metric's name, help, label names, and its series by label values."""

    def __init__(self, name: str, documentation: str, label_names: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.label_names = tuple(label_names)
        self.series: dict[tuple[str, ...], SeriesT] = {}

    def labels(self, *values: str) -> SeriesT:
        """The series of these label values (created at 0 on first use)."""
        series = self.series.get(values)
        if series is None:
            if len(values) != len(self.label_names):
                raise ValueError(f"this is a bug: {self.name} takes labels {self.label_names}")
            series = self.series.setdefault(values, self._new_series())
        return series

    def _new_series(self) -> SeriesT:
        raise NotImplementedError

    def described(self) -> Metric:
        """This family without samples: its name, help, type and label names."""
        raise NotImplementedError

    def exposed(self) -> Metric:
        """This family with a sample set per series, as prometheus_client writes them."""
        raise NotImplementedError


class CounterFamily(_Family[CounterSeries]):
    def __init__(self, name: str, documentation: str, label_names: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, label_names)

    def _new_series(self) -> CounterSeries:
        return CounterSeries()

    def described(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.label_names)

    def exposed(self) -> Metric:
        counter = self.described()
        for values, series in self.series.items():
            counter.add_metric(list(values), series.value)
        return counter


class HistogramFamily(_Family[HistogramSeries]):
    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        label_names: Sequence[str] = (),
    ) -> None:
        super().__init__(name, documentation, label_names)
        self.upper_bounds = tuple(sorted(float(b) for b in buckets if not math.isinf(b)))
        # The "le" labels as prometheus_client writes them ("0.00025", "1.0", "+Inf").
        self._le_labels = [floatToGoString(b) for b in self.upper_bounds] + ["+Inf"]  # type: ignore[no-untyped-call]

    def _new_series(self) -> HistogramSeries:
        return HistogramSeries(self.upper_bounds)

    def described(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.label_names)

    def exposed(self) -> Metric:
        histogram = self.described()
        for values, series in self.series.items():
            cumulative, buckets = 0, []
            for bound, count in zip(self._le_labels, series.counts, strict=True):
                cumulative += count
                buckets.append((bound, float(cumulative)))
            histogram.add_metric(list(values), buckets, series.sum)
        return histogram


class RequestMetricsCollector(Collector):
    """Exposes the families, read under ``lock`` (the one their updates are applied under)
    once ``apply_pending`` has applied what is pending: a scrape filtered by name selects
    this collector alone (see ``describe``) and must not read stale numbers."""

    def __init__(
        self,
        families: Sequence[CounterFamily | HistogramFamily],
        lock: threading.Lock,
        apply_pending: Callable[[], None],
    ) -> None:
        self._families = tuple(families)
        self._lock = lock
        self._apply_pending = apply_pending

    def collect(self) -> Iterator[Metric]:
        self._apply_pending()  # takes the lock itself, which is not re-entrant
        with self._lock:
            metrics = [family.exposed() for family in self._families]
        return iter(metrics)

    def describe(self) -> Iterator[Metric]:
        """The families without their samples: the registry learns their names from this
        (a scrape filtered by name, ``/metrics?name[]=...``, selects collectors by them,
        and the registry refuses a second metric of the same name)."""
        return iter([family.described() for family in self._families])
