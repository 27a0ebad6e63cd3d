"""The client's exception tree, and the one table that maps gRPC statuses onto it.

Everything the client raises derives from :class:`EmbeddingError`::

    EmbeddingError                 .code (grpc.StatusCode | None), .reason (str | None)
    ├── InvalidInputError          INVALID_ARGUMENT: bad ids, dtype, shape, lengths, empty
    ├── RequestTooLargeError       RESOURCE_EXHAUSTED/too_large: never retried
    ├── OverloadedError            RESOURCE_EXHAUSTED/overloaded: retried if asked
    ├── ModelNotFoundError         NOT_FOUND: the model named is not served here
    ├── UnavailableError           UNAVAILABLE: unreachable, draining, not ready; retried
    ├── DeadlineExceededError      DEADLINE_EXCEEDED
    ├── RequestCancelledError      CANCELLED (not named CancelledError: asyncio has one)
    ├── AuthenticationError        UNAUTHENTICATED, PERMISSION_DENIED
    ├── ModelLoadError             FAILED_PRECONDITION/load_failed: a load that failed
                                   (what served before serves still)
    ├── ServerError                INTERNAL, UNKNOWN, anything else
    ├── SharedMemoryUnavailableError  a shared-memory session the server cannot use
    │                              (``EmbeddingClient.shared_memory``; not from a status)
    └── UnknownConventionError     an engine payload (vLLM's, SGLang's) asked of a model
                                   whose architecture records no convention for that
                                   engine (``client/engines.py``; not from a status)

The server puts the cause in the trailing metadata ``tokembed-error-reason``; the status
code alone cannot tell "this request is too large" (retrying is pointless) from "the
server is busy" (retrying later may work), both RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

REASON_METADATA_KEY = "tokembed-error-reason"

# The reasons the client tells apart: the two of RESOURCE_EXHAUSTED (the server's other
# reasons add nothing to their status code).
REASON_TOO_LARGE = "too_large"
REASON_OVERLOADED = "overloaded"
# The reasons of errors the client detects itself: input it refuses before sending, and
# an answer that broke the protocol (wrong sizes, missing header).
REASON_INVALID_INPUT = "invalid_input"
REASON_PROTOCOL = "protocol"


class EmbeddingError(Exception):
    """Base of every error the client raises.

    ``code`` is the gRPC status code (``None`` when no status was involved, e.g. a
    missing optional dependency or a reply that broke the protocol), ``reason`` the
    server's ``tokembed-error-reason`` (or the client's own, for errors it detects
    before sending), ``details`` the server's message, ``attempts`` how many attempts
    were made before giving up (more than 1 only after retries).
    """

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        reason: str | None = None,
        details: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.details = details if details is not None else message
        self.attempts = 1


class InvalidInputError(EmbeddingError):
    """The ids, dtype, shape or lengths are not acceptable (INVALID_ARGUMENT)."""


class RequestTooLargeError(EmbeddingError):
    """More tokens or output bytes than one request may carry. Retrying cannot help:
    split the input, or ask for float16."""


class OverloadedError(EmbeddingError):
    """The server's queue is full. Retried when the client has ``retry_on_overload``."""


class ModelNotFoundError(EmbeddingError):
    """The call named a model that this server does not serve (NOT_FOUND); the server's
    message lists the models it serves."""


class UnavailableError(EmbeddingError):
    """The server cannot be reached, is starting, or is draining (UNAVAILABLE)."""


class DeadlineExceededError(EmbeddingError):
    """The call's timeout passed before the answer came (DEADLINE_EXCEEDED)."""


class RequestCancelledError(EmbeddingError):
    """The call was cancelled (CANCELLED)."""


class AuthenticationError(EmbeddingError):
    """The bearer token is missing or wrong (UNAUTHENTICATED), or access is denied."""


class ModelLoadError(EmbeddingError):
    """A model load failed (a version whose files are cut short, do not match their
    sha256, or hold a graph that does not load; a load over the memory bound): the
    message is the server's reason, which its repository index gives too."""


class ServerError(EmbeddingError):
    """The server failed (INTERNAL, UNKNOWN, any other status), or its reply broke the
    protocol (``code`` None, ``reason`` "protocol")."""


class SharedMemoryUnavailableError(EmbeddingError):
    """The server cannot use this client's shared memory: it has shared memory off, runs
    on another host (or in another container), cannot open the object, or takes another
    prefix. The message is the server's; ``code`` is the registration's status."""


class UnknownConventionError(EmbeddingError):
    """An engine's payload asked of a model whose architecture (``ModelInfo.architecture``)
    records no convention for that engine: the scale it expects is not known, so no
    payload is made rather than a possibly wrong one."""


# The one table: (status code, reason) -> class. A (code, None) row is the fallback for
# that code whatever the reason; codes absent from the table are ServerError.
_ERROR_TABLE: dict[tuple[grpc.StatusCode, str | None], type[EmbeddingError]] = {
    (grpc.StatusCode.INVALID_ARGUMENT, None): InvalidInputError,
    (grpc.StatusCode.RESOURCE_EXHAUSTED, REASON_TOO_LARGE): RequestTooLargeError,
    (grpc.StatusCode.RESOURCE_EXHAUSTED, REASON_OVERLOADED): OverloadedError,
    # The server always names its reason; a RESOURCE_EXHAUSTED without one comes from
    # gRPC itself refusing a message over its size limit, which is "too large" (and a
    # retry would only repeat it).
    (grpc.StatusCode.RESOURCE_EXHAUSTED, None): RequestTooLargeError,
    (grpc.StatusCode.NOT_FOUND, None): ModelNotFoundError,
    (grpc.StatusCode.UNAVAILABLE, None): UnavailableError,
    (grpc.StatusCode.DEADLINE_EXCEEDED, None): DeadlineExceededError,
    (grpc.StatusCode.CANCELLED, None): RequestCancelledError,
    (grpc.StatusCode.UNAUTHENTICATED, None): AuthenticationError,
    (grpc.StatusCode.PERMISSION_DENIED, None): AuthenticationError,
    (grpc.StatusCode.FAILED_PRECONDITION, "load_failed"): ModelLoadError,
}

_CODES_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def error_class(code: grpc.StatusCode | None, reason: str | None) -> type[EmbeddingError]:
    """The exception class for a status code and reason (see the table above)."""
    if code is None:
        return ServerError
    return _ERROR_TABLE.get((code, reason)) or _ERROR_TABLE.get((code, None)) or ServerError


def from_status(
    code: grpc.StatusCode | None, reason: str | None, details: str | None
) -> EmbeddingError:
    """Build the typed error for a status; the message names code, reason and details."""
    cls = error_class(code, reason)
    name = code.name if code is not None else "no status"
    label = f"{name} ({reason})" if reason else name
    message = f"{label}: {details}" if details else label
    return cls(message, code=code, reason=reason, details=details or "")


def status_code_from_number(number: int) -> grpc.StatusCode:
    """``google.rpc.Code`` number (as in the stream's ``Error.code``) to grpc.StatusCode."""
    return _CODES_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def reason_from_metadata(metadata: Iterable[Any] | None) -> str | None:
    """The ``tokembed-error-reason`` value in trailing metadata, if any.

    Works for the sync API's tuple of ``(key, value)`` pairs and for grpc.aio's
    ``Metadata`` (which iterates as pairs too).
    """
    if not metadata:
        return None
    for item in metadata:
        key, value = item[0], item[1]
        if key == REASON_METADATA_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def from_rpc_error(exc: grpc.RpcError) -> EmbeddingError:
    """Map a gRPC error (sync or asyncio) to the typed error; use as ``raise ... from exc``."""
    code = _call(exc, "code")
    details = _call(exc, "details")
    metadata = _call(exc, "trailing_metadata")
    if not isinstance(code, grpc.StatusCode):
        code = None
    return from_status(
        code,
        reason_from_metadata(metadata),
        details if isinstance(details, str) else (str(exc) or type(exc).__name__),
    )


def _call(exc: object, method: str) -> Any:
    # A bare grpc.RpcError has none of the grpc.Call methods; the ones calls raise do.
    fn = getattr(exc, method, None)
    if fn is None:
        return None
    try:
        return fn()
    except Exception:  # a half-built error object must not hide the original failure
        return None


def protocol_error(message: str) -> ServerError:
    """The server's reply broke the protocol (a server bug, or not a tokembed server)."""
    return ServerError(
        f"malformed reply from the server: {message}", code=None, reason=REASON_PROTOCOL
    )


def client_invalid_input(message: str) -> InvalidInputError:
    """Input the client refuses before sending it. It carries INVALID_ARGUMENT, the code
    the server would answer with, so callers handle both the same way."""
    return InvalidInputError(
        message, code=grpc.StatusCode.INVALID_ARGUMENT, reason=REASON_INVALID_INPUT
    )
