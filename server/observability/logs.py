"""Logging set-up for ``tokembed serve``: plain text for people, JSON lines for pipelines.

Messages carry clients' strings (model and input names, request ids): in the text format
their control characters are escaped, so that a newline a client sends cannot start a
line that reads as the server's own; JSON escapes them by itself.
"""

from __future__ import annotations

import json
import logging
import sys
import time

# C0 and C1 control characters, DEL and Unicode's line and paragraph separators: what can
# break a line or rewrite a terminal. Written as Python writes them in a string's repr.
_CONTROLS = {
    code: repr(chr(code))[1:-1] for code in (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029)
}

# Attributes every LogRecord has; anything else was passed with extra={...}.
_STANDARD_ATTRIBUTES = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: written here (python-json-logger would do it) since these
    few lines spare the server a dependency."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRIBUTES and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


def escape_controls(text: str) -> str:
    return text.translate(_CONTROLS)


class TextFormatter(logging.Formatter):
    """One line per record (and the traceback, when there is one, below it)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape_controls(super().formatMessage(record))


class CallEndedFirst(logging.Filter):
    """gRPC's asyncio server logs an ERROR with a traceback when it cannot send a unary
    answer because the call ended first: its client cancelled, or its deadline passed
    while the handler finished (grpc/grpc#32551 made it a log line rather than a lost
    task). That is a client leaving, not a fault of the server: said in one INFO line,
    without the traceback, so that an operator's error count means errors."""

    PREFIX = "ExecuteBatchError raised in core by servicer method"

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(self.PREFIX):
            method = record.getMessage().removeprefix(self.PREFIX).strip(" []")
            record.msg, record.args = "%s: the call ended before its answer was sent", (method,)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
        return True


# Where gRPC's asyncio server logs (its Cython module's logger).
GRPC_SERVER_LOGGER = "grpc._cython.cygrpc"


def configure_logging(level: str, fmt: str) -> None:
    grpc_server = logging.getLogger(GRPC_SERVER_LOGGER)
    if not any(isinstance(known, CallEndedFirst) for known in grpc_server.filters):
        grpc_server.addFilter(CallEndedFirst())
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
