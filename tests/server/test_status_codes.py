"""The one table from domain errors to gRPC status codes, and the reason metadata."""

from __future__ import annotations

import grpc
import pytest

from tokembed.server.core import errors
from tokembed.server.edge.status_codes import (
    REASON_METADATA_KEY,
    STATUS_BY_ERROR,
    status_of,
    trailing_metadata,
)
from tokembed.server.edge.v2 import status as v2_status
from tokembed.server.observability.metrics import REJECTION_REASONS

EXPECTED = {
    errors.InvalidInput: (grpc.StatusCode.INVALID_ARGUMENT, "invalid_input"),
    errors.TooLarge: (grpc.StatusCode.RESOURCE_EXHAUSTED, "too_large"),
    errors.Overloaded: (grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded"),
    errors.ModelNotFound: (grpc.StatusCode.NOT_FOUND, "not_found"),
    errors.Unavailable: (grpc.StatusCode.UNAVAILABLE, "unavailable"),
    errors.DeadlineExceeded: (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_exceeded"),
    errors.Cancelled: (grpc.StatusCode.CANCELLED, "cancelled"),
    errors.Unauthenticated: (grpc.StatusCode.UNAUTHENTICATED, "unauthenticated"),
    errors.ControlRefused: (grpc.StatusCode.PERMISSION_DENIED, "control_refused"),
    errors.LoadFailed: (grpc.StatusCode.FAILED_PRECONDITION, "load_failed"),
    errors.Internal: (grpc.StatusCode.INTERNAL, "internal"),
}


def test_every_domain_error_class_is_in_the_table() -> None:
    declared = set(errors.EmbedError.__subclasses__())
    assert declared == set(EXPECTED), "a new error class needs a row here and in status.py"
    assert set(STATUS_BY_ERROR) == declared
    assert set(v2_status.STATUS_BY_ERROR) == declared  # the Open Inference Protocol's own


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda cls: cls.__name__)
def test_status_code_and_reason_metadata(cls: type[errors.EmbedError]) -> None:
    code, reason = EXPECTED[cls]
    error = cls("some message")
    assert status_of(error) == code
    assert error.reason == reason
    assert trailing_metadata(error) == ((REASON_METADATA_KEY, error.reason),)
    # Metrics pre-create a rejections series for every reason the edge can report.
    assert error.reason in REJECTION_REASONS


def test_reason_metadata_key_is_a_valid_ascii_header() -> None:
    assert REASON_METADATA_KEY.lower() == REASON_METADATA_KEY
    assert not REASON_METADATA_KEY.endswith("-bin")


def test_too_large_and_overloaded_share_a_code_but_not_a_reason() -> None:
    too_large, overloaded = errors.TooLarge("x"), errors.Overloaded("y")
    assert status_of(too_large) == status_of(overloaded)
    assert trailing_metadata(too_large) != trailing_metadata(overloaded)


def test_subclasses_inherit_their_parents_code_and_unknown_errors_are_internal() -> None:
    class Ragged(errors.InvalidInput):
        pass

    assert status_of(Ragged("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert trailing_metadata(Ragged("x")) == ((REASON_METADATA_KEY, "invalid_input"),)
    assert status_of(errors.EmbedError("x")) == grpc.StatusCode.INTERNAL


def test_every_status_code_of_the_table_has_a_requests_series_from_the_start() -> None:
    # Each way a call can end (core.calls.OUTCOMES, per operation, before and after it
    # reached a model) has its series at 0 before any call, under the code this table
    # gives it, so rate() sees the first one; together they use every code of the table.
    from prometheus_client import CollectorRegistry

    from tokembed.server.core.calls import OUTCOMES
    from tokembed.server.edge.v1.servicer import FRONT_END
    from tokembed.server.observability.metrics import Metrics

    assert FRONT_END.ok == "OK"
    registry = CollectorRegistry()
    metrics = Metrics(registry, process_collector=False)
    metrics.add_front_end(FRONT_END)
    metrics.add_model("small", "")
    started: set[str] = set()
    for method, operation in FRONT_END.methods.items():
        outcomes = OUTCOMES[operation]
        for model, errors_ in (("", outcomes.without_model), ("small", outcomes.with_model)):
            codes = {status_of(error("x")).name for error in errors_}
            if outcomes.ok_with_model == bool(model):
                codes.add("OK")
            for code in codes:
                labels = {"protocol": "tokembed.v1", "operation": operation, "method": method,
                          "code": code, "model": model, "version": ""}  # fmt: skip
                assert registry.get_sample_value("tokembed_requests_total", labels) == 0, labels
            started |= codes
    # The control methods' errors (load, unload: no data call ends with them) aside.
    control = {errors.ControlRefused, errors.LoadFailed}
    data_codes = {code.name for error, code in STATUS_BY_ERROR.items() if error not in control}
    assert started == {"OK"} | data_codes
    assert not started & {STATUS_BY_ERROR[error].name for error in control}
