"""The Open Inference Protocol's table from domain errors to gRPC status codes.

Its own table, not tokembed.v1's, because the codes are this protocol's promise to its
clients. They agree with tokembed.v1's today, and with what V2 servers answer:

- a malformed request (datatype, shape, ids out of range): INVALID_ARGUMENT, as Triton;
- a model this server does not serve: NOT_FOUND, as KServe and MLServer (and Triton for
  an unknown version; Triton answers an unknown name with INVALID_ARGUMENT);
- a model loading or draining, or the server draining: UNAVAILABLE, as Triton for a
  version not ready (clients retry it);
- over a per-request limit, or no room now: RESOURCE_EXHAUSTED, told apart by the
  ``tokembed-error-reason`` trailing metadata (``too_large``: do not retry as is;
  ``overloaded``: retry later), as tokembed.v1 tells them.

A stream's failed request is answered by a ``ModelStreamInferResponse`` whose
``error_message`` is the error's message, as Triton does; the stream goes on.
"""

from __future__ import annotations

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
from tokembed.server.edge.status_codes import StatusTable

# The same codes as tokembed.v1's today (see above): a code this protocol comes to answer
# differently is a line here, not a change to tokembed.v1's table.
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
V2 = StatusTable(STATUS_BY_ERROR)
status_of = V2.status_of
status_name = V2.status_name
