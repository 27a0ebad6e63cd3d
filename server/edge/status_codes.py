"""The one table from domain errors to gRPC status codes (the gRPC edge).

Each error also travels as trailing metadata ``tokembed-error-reason`` so the client can
tell "too large, do not retry" from "overloaded, retry later" (both RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import grpc

from tokembed.server.core.errors import (
    Cancelled,
    DeadlineExceeded,
    EmbedError,
    Internal,
    InvalidInput,
    ModelNotFound,
    Overloaded,
    TooLarge,
    Unauthenticated,
    Unavailable,
)

REASON_METADATA_KEY = "tokembed-error-reason"

STATUS_BY_ERROR: dict[type[EmbedError], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    TooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Cancelled: grpc.StatusCode.CANCELLED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    Internal: grpc.StatusCode.INTERNAL,
}
# Every code the table gives, by name (the metrics start a series at 0 for each).
CODE_NAMES = tuple(dict.fromkeys(code.name for code in STATUS_BY_ERROR.values()))


def status_of(error: EmbedError) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in STATUS_BY_ERROR:
            return STATUS_BY_ERROR[cls]
    return grpc.StatusCode.INTERNAL


def status_name(error: EmbedError) -> str:
    """The status code's name (``FrontEnd.status_of``)."""
    return str(status_of(error).name)


def trailing_metadata(error: EmbedError) -> tuple[tuple[str, str], ...]:
    return ((REASON_METADATA_KEY, error.reason),)
