"""The status -> exception table, and from_rpc_error on real and odd RpcErrors."""

from __future__ import annotations

import asyncio

import grpc
import pytest

import tokembed.client as client
from tokembed.client import (
    AuthenticationError,
    DeadlineExceededError,
    EmbeddingError,
    InvalidInputError,
    ModelNotFoundError,
    OverloadedError,
    RequestCancelledError,
    RequestTooLargeError,
    ServerError,
    UnavailableError,
    from_rpc_error,
)
from tokembed.client.errors import (
    error_class,
    from_status,
    reason_from_metadata,
    status_code_from_number,
)

SC = grpc.StatusCode

TABLE = [
    (SC.INVALID_ARGUMENT, "invalid_input", InvalidInputError),
    (SC.RESOURCE_EXHAUSTED, "too_large", RequestTooLargeError),
    (SC.RESOURCE_EXHAUSTED, "overloaded", OverloadedError),
    (SC.NOT_FOUND, "not_found", ModelNotFoundError),
    (SC.UNAVAILABLE, "unavailable", UnavailableError),
    (SC.DEADLINE_EXCEEDED, "deadline_exceeded", DeadlineExceededError),
    (SC.CANCELLED, "cancelled", RequestCancelledError),
    (SC.UNAUTHENTICATED, "unauthenticated", AuthenticationError),
    (SC.PERMISSION_DENIED, None, AuthenticationError),
    (SC.INTERNAL, "internal", ServerError),
    (SC.UNKNOWN, None, ServerError),
    (SC.UNIMPLEMENTED, None, ServerError),
    (SC.DATA_LOSS, None, ServerError),
    # The server always sends a reason; without one RESOURCE_EXHAUSTED comes from gRPC's
    # own message-size check: too large, and so never retried.
    (SC.RESOURCE_EXHAUSTED, None, RequestTooLargeError),
    (SC.RESOURCE_EXHAUSTED, "something_new", RequestTooLargeError),
    # The code decides first; a reason cannot turn INVALID_ARGUMENT into something else.
    (SC.INVALID_ARGUMENT, "overloaded", InvalidInputError),
]


@pytest.mark.parametrize(("code", "reason", "cls"), TABLE)
def test_table(code: grpc.StatusCode, reason: str | None, cls: type[EmbeddingError]) -> None:
    assert error_class(code, reason) is cls
    err = from_status(code, reason, "the server's words")
    assert type(err) is cls
    assert isinstance(err, EmbeddingError)
    assert err.code is code
    assert err.reason == reason
    assert err.details == "the server's words"
    assert code.name in str(err)
    assert "the server's words" in str(err)
    if reason:
        assert f"({reason})" in str(err)


def test_no_code_is_a_server_error() -> None:
    assert error_class(None, None) is ServerError


def test_cancelled_error_does_not_shadow_asyncio() -> None:
    assert not issubclass(RequestCancelledError, asyncio.CancelledError)
    assert not hasattr(client, "CancelledError")


def test_every_public_error_derives_from_embedding_error() -> None:
    names = [n for n in client.__all__ if n.endswith("Error")]
    assert len(names) == 13  # the tree in client/errors.py's docstring
    for name in names:
        assert issubclass(getattr(client, name), EmbeddingError)


def test_status_numbers() -> None:
    assert status_code_from_number(3) is SC.INVALID_ARGUMENT
    assert status_code_from_number(8) is SC.RESOURCE_EXHAUSTED
    assert status_code_from_number(12345) is SC.UNKNOWN


def test_reason_from_metadata_forms() -> None:
    assert reason_from_metadata(None) is None
    assert reason_from_metadata(()) is None
    assert reason_from_metadata((("other", "x"), ("tokembed-error-reason", "overloaded"))) == (
        "overloaded"
    )
    assert reason_from_metadata((("tokembed-error-reason", b"too_large"),)) == "too_large"
    aio_md = grpc.aio.Metadata(("tokembed-error-reason", "unavailable"))
    assert reason_from_metadata(aio_md) == "unavailable"


class FakeCall(grpc.RpcError):
    """What grpc raises: an RpcError that is also a grpc.Call."""

    def __init__(self, code: grpc.StatusCode, details: str, metadata: tuple[tuple[str, str], ...]):
        super().__init__()
        self._code, self._details, self._metadata = code, details, metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


def test_from_rpc_error_reads_code_details_and_reason() -> None:
    exc = FakeCall(SC.RESOURCE_EXHAUSTED, "queue full", (("tokembed-error-reason", "overloaded"),))
    err = from_rpc_error(exc)
    assert isinstance(err, OverloadedError)
    assert (err.code, err.reason, err.details) == (
        SC.RESOURCE_EXHAUSTED,
        "overloaded",
        "queue full",
    )


def test_from_rpc_error_on_a_bare_rpc_error() -> None:
    err = from_rpc_error(grpc.RpcError("boom"))
    assert isinstance(err, ServerError)
    assert err.code is None
    assert "boom" in str(err)


def test_raise_from_keeps_the_grpc_cause() -> None:
    exc = FakeCall(SC.UNAVAILABLE, "connection refused", ())
    with pytest.raises(UnavailableError) as info:
        try:
            raise exc
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
    assert info.value.__cause__ is exc
    assert info.value.attempts == 1
