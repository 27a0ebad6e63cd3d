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

from tokembed.server.core.errors import EmbedError
from tokembed.server.edge import status_codes

# The same codes as tokembed.v1's today (see above): a code this protocol comes to answer
# differently is a line here, not a change to tokembed.v1's table.
STATUS_BY_ERROR: dict[type[EmbedError], grpc.StatusCode] = dict(status_codes.STATUS_BY_ERROR)


def status_of(error: EmbedError) -> grpc.StatusCode:
    return status_codes.status_in(STATUS_BY_ERROR, error)


def status_name(error: EmbedError) -> str:
    """The status code's name (``FrontEnd.status_of``)."""
    return str(status_of(error).name)
