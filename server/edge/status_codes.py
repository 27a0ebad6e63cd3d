"""Domain errors to gRPC status codes (the gRPC edge): tokembed.v1's table, and the one
way any protocol's table is read and a call ended with it (``StatusTable``; the Open
Inference Protocol's own table is ``edge.v2.status``).

Each error also travels as trailing metadata ``tokembed-error-reason`` so the client can
tell "too large, do not retry" from "overloaded, retry later" (both RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NoReturn

import grpc

from tokembed.server.core.errors import (
    Cancelled,
    ControlRefused,
    DeadlineExceeded,
    EmbedError,
    Internal,
    InvalidInput,
    LoadFailed,
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
    ControlRefused: grpc.StatusCode.PERMISSION_DENIED,
    LoadFailed: grpc.StatusCode.FAILED_PRECONDITION,
    Internal: grpc.StatusCode.INTERNAL,
}


class StatusTable:
    """A protocol's promise to its clients, as data: the code each domain error class
    gets. How an error finds its code, and how a call ends with it, are written here once
    for every protocol."""

    def __init__(self, codes: Mapping[type[EmbedError], grpc.StatusCode]) -> None:
        self.codes = codes

    def status_of(self, error: EmbedError) -> grpc.StatusCode:
        """The code for ``error``'s class, or its nearest base's (else INTERNAL)."""
        for cls in type(error).__mro__:
            if cls in self.codes:
                return self.codes[cls]
        return grpc.StatusCode.INTERNAL

    def status_name(self, error: EmbedError) -> str:
        """The status code's name (``FrontEnd.status_of``)."""
        return str(self.status_of(error).name)

    async def abort(self, context: grpc.aio.ServicerContext, error: EmbedError) -> NoReturn:
        """End the call now with ``error``'s code, its message and its reason (a unary call
        that holds a large request ends by ``refuse`` instead: see there why)."""
        await context.abort(
            self.status_of(error), str(error), trailing_metadata=trailing_metadata(error)
        )
        raise AssertionError("this is a bug: context.abort returned")


TOKEMBED_V1 = StatusTable(STATUS_BY_ERROR)
status_of = TOKEMBED_V1.status_of
status_name = TOKEMBED_V1.status_name


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
