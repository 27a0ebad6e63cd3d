"""A served call's status code is its front end's (``FrontEnd.ok``), in the metrics, the
ModelStatistics totals and the log alike: no other place names it."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from tokembed.server.core.calls import Call, Calls, Delivered, FrontEnd
from tokembed.server.core.dtypes import FLOAT32
from tokembed.server.core.errors import EmbedError
from tokembed.server.core.types import Timings
from tokembed.server.observability.metrics import Metrics

# A protocol whose served calls end with a status named otherwise than gRPC's "OK".
FRONT_END = FrontEnd(
    protocol="test.other",
    methods={"Infer": "embed", "Info": "model_info"},
    status_of=lambda error: f"FAILED_{error.reason.upper()}",
    ok="SUCCESS",
)


def _call(method: str) -> Call:
    call = Call(FRONT_END, method, "")
    call.model = "enc"
    return call


def test_a_served_call_is_counted_with_its_front_ends_ok_code(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry, process_collector=False)
    metrics.add_front_end(FRONT_END)
    calls = Calls(metrics)
    delivered = Delivered((1, 4), FLOAT32, 1, 16, Timings(0.0, 0.0, 1, 1), None)
    with caplog.at_level(logging.DEBUG, logger="tokembed.server.servicer"):
        calls.served(_call("Infer"), delivered)
    calls.answered(_call("Info"))
    calls.refused(_call("Infer"), EmbedError("broken"))

    def requests(method: str, code: str) -> float | None:
        labels = {"protocol": FRONT_END.protocol, "operation": FRONT_END.methods[method],
                  "method": method, "code": code, "model": "enc", "version": ""}  # fmt: skip
        return registry.get_sample_value("tokembed_requests_total", labels)

    assert requests("Infer", "SUCCESS") == 1
    assert requests("Info", "SUCCESS") == 1
    assert requests("Infer", "FAILED_INTERNAL") == 1
    assert requests("Infer", "OK") is None
    totals = metrics.model_totals("enc")
    assert totals is not None and (totals.success_count, totals.fail_count) == (1, 1)
    served = [record for record in caplog.records if " ok " in record.getMessage()]
    assert [record.code for record in served] == ["SUCCESS"]  # type: ignore[attr-defined]
