"""A call that ended before its answer was sent (its client cancelled, its deadline passed)
is one INFO line in the server's log, not an ERROR with gRPC's traceback; gRPC's other
errors keep theirs."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from tokembed.server.observability.logs import GRPC_SERVER_LOGGER, CallEndedFirst, configure_logging


@pytest.fixture
def configured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    root, grpc_server = logging.getLogger(), logging.getLogger(GRPC_SERVER_LOGGER)
    handlers, level, filters = root.handlers[:], root.level, grpc_server.filters[:]
    configure_logging("info", "text")
    configure_logging("info", "text")  # a second set-up adds no second filter
    written = io.StringIO()
    (handler,) = root.handlers
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(written)  # the server's handler, writing where the test reads
    yield grpc_server, written
    root.handlers[:], grpc_server.filters[:] = handlers, filters
    root.setLevel(level)


def _raised() -> BaseException:
    try:
        raise RuntimeError('Failed "execute_batch"')
    except RuntimeError as exc:
        return exc


def test_a_call_ended_first_is_one_info_line(
    configured: tuple[logging.Logger, io.StringIO],
) -> None:
    grpc_server, written = configured
    assert sum(isinstance(f, CallEndedFirst) for f in grpc_server.filters) == 1
    error = _raised()
    grpc_server.error(
        "ExecuteBatchError raised in core by servicer method [%s]",
        "/inference.GRPCInferenceService/SystemSharedMemoryUnregister",
        exc_info=(type(error), error, error.__traceback__),
    )
    lines = written.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert " INFO grpc._cython.cygrpc: " in lines[0]
    assert lines[0].endswith(
        "/inference.GRPCInferenceService/SystemSharedMemoryUnregister: the call ended before "
        "its answer was sent"
    )


def test_other_grpc_errors_keep_their_level_and_traceback(
    configured: tuple[logging.Logger, io.StringIO],
) -> None:
    grpc_server, written = configured
    error = _raised()
    grpc_server.error("Unexpected [%s] raised by servicer method", "ValueError", exc_info=error)
    err = written.getvalue()
    assert " ERROR grpc._cython.cygrpc: Unexpected [ValueError]" in err
    assert "Traceback (most recent call last)" in err
