"""The server's domain errors: why a request failed, with no transport in sight.

Each front end maps each class to a status code in one table (gRPC's:
``edge/status_codes.py``); every message names the offending value so a caller can fix
the request.

    EmbedError
     ├── InvalidInput        the request is malformed (ids, dtype, shape, lengths)
     ├── TooLarge            over a per-request limit (tokens, output bytes)
     ├── Overloaded          admission refused: the server is full right now
     ├── ModelNotFound       the request names a model this server does not serve
     │    └── ModelUnloaded  one unloaded on purpose (it may be loaded again)
     ├── Unavailable         not ready yet, or draining
     ├── DeadlineExceeded    the caller's deadline passed before compute
     ├── Cancelled           the caller went away
     ├── Unauthenticated     no bearer token, or a wrong one
     ├── ControlRefused      a control call (load, unload, index) this server does not allow
     ├── LoadFailed          a model (version) could not be loaded; what serves is untouched
     └── Internal            a bug or a runtime failure; logged with its traceback
"""

from __future__ import annotations


class EmbedError(Exception):
    """A request failed; ``reason`` is the stable label used in metrics and metadata."""

    reason = "internal"


class InvalidInput(EmbedError):
    reason = "invalid_input"


class TooLarge(EmbedError):
    reason = "too_large"


class Overloaded(EmbedError):
    reason = "overloaded"


class ModelNotFound(EmbedError):
    reason = "not_found"


class ModelUnloaded(ModelNotFound):
    """The model was unloaded on purpose (it may be loaded again)."""


class Unavailable(EmbedError):
    reason = "unavailable"


class DeadlineExceeded(EmbedError):
    reason = "deadline_exceeded"


class Cancelled(EmbedError):
    reason = "cancelled"


class Unauthenticated(EmbedError):
    reason = "unauthenticated"


class ControlRefused(EmbedError):
    reason = "control_refused"


class LoadFailed(EmbedError):
    reason = "load_failed"


class Internal(EmbedError):
    reason = "internal"


class ServerConfigError(Exception):
    """The server cannot start: bad settings, invalid model directory, missing provider."""
