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


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
