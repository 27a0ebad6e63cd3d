"""The one table from domain errors to gRPC status codes (the gRPC edge).

Each error also travels as trailing metadata ``tokembed-error-reason`` so the client can
tell "too large, do not retry" from "overloaded, retry later" (both RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

from collections.abc import Mapping

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


def status_in(
    table: Mapping[type[EmbedError], grpc.StatusCode], error: EmbedError
) -> grpc.StatusCode:
    """The code ``table`` gives ``error``'s class, or its nearest base's (else INTERNAL)."""
    for cls in type(error).__mro__:
        if cls in table:
            return table[cls]
    return grpc.StatusCode.INTERNAL


def status_of(error: EmbedError) -> grpc.StatusCode:
    return status_in(STATUS_BY_ERROR, error)


def status_name(error: EmbedError) -> str:
    """The status code's name (``FrontEnd.status_of``)."""
    return str(status_of(error).name)


def trailing_metadata(error: EmbedError) -> tuple[tuple[str, str], ...]:
    return ((REASON_METADATA_KEY, error.reason),)


def refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, error: EmbedError) -> None:
    """End a unary call with ``code`` and ``error``'s message and reason once its handler
    returns (what it returns is then discarded). Not ``context.abort``: gRPC keeps the
    exception that raises on the call's state, and its traceback holds the handler's
    frames, which hold the context and the request: a cycle that keeps a refused
    request's bytes until the cyclic collector runs."""
    context.set_code(code)
    context.set_details(str(error))
    context.set_trailing_metadata(trailing_metadata(error))
