"""``tokembed <subcommand>``: dispatch to the room that owns each subcommand.

Each room registers its own parser; imports are deferred so that ``tokembed embed``
never loads torch and ``tokembed export`` never loads grpc's server.
A domain error becomes one line on stderr and exit status 2, never a traceback; so does a
subcommand run without the extra that brings its packages (``_EXTRAS``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from tokembed import __version__

# module that provides add_parser(subparsers), in the order --help lists them
_SUBCOMMAND_MODULES = (
    "tokembed.export.cli",
    "tokembed.export.triton",
    "tokembed.server.process.cli",
    "tokembed.cli.client",
    "tokembed.bench.cli",
)


@dataclass(frozen=True)
class Extra:
    """What a subcommand needs beyond the base install (the client): how to install it,
    and the modules it brings, by the top-level name a ModuleNotFoundError gives."""

    install: str
    modules: frozenset[str]


_SERVER = frozenset(
    {"onnxruntime", "onnx", "prometheus_client", "grpc_health", "grpc_reflection", "tokenizers"}
)
_EXPORT = frozenset({"torch", "onnx", "onnxruntime", "safetensors", "tokenizers"})
# The subcommands that need an extra; the others need only the base install. A module
# missing that is not the extra's is a broken install or a bug, and keeps its traceback.
_EXTRAS = {
    "serve": Extra("pip install 'tokembed[server]' ('tokembed[gpu]' on a GPU)", _SERVER),
    "export-triton": Extra("pip install 'tokembed[server]'", _SERVER),
    "export": Extra(
        "install a CPU torch and tokembed[export] (see the README); --builtin needs only "
        "tokembed[server]",
        _EXPORT,
    ),
    # Its models are exported with torch the first time, its plots drawn by matplotlib.
    "bench": Extra(
        "install a CPU torch and tokembed[server,export,bench] (see the README)",
        _SERVER | _EXPORT | {"matplotlib", "psutil"},
    ),
}


def missing_extra(command: str, exc: ModuleNotFoundError) -> str | None:
    """The line that says which extra ``command`` needs, when ``exc`` is one of its
    packages missing; None otherwise."""
    extra = _EXTRAS.get(command)
    module = (exc.name or "").partition(".")[0]
    if extra is None or module not in extra.modules:
        return None
    return f"tokembed {command} needs {module}, which is not installed: {extra.install}"


class OneLineErrors(argparse.ArgumentParser):
    """A mistake on the command line is one line (argparse prints its whole usage too),
    naming what is wrong and where the full usage is; exit status 2, as argparse's."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    # Subcommands' parsers are made of the same class (argparse uses the parent's).
    parser = OneLineErrors(
        prog="tokembed",
        description="Serve the input-embedding layer of a Transformer over gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"tokembed {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # A room whose package is not installed simply offers no subcommand.
            if exc.name and exc.name.startswith("tokembed."):
                continue
            raise
        module.add_parser(subparsers)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message is for the user; anything else is a bug and keeps its traceback."""
    from tokembed.export.errors import ExportError, ModelDirError

    errors: list[type[BaseException]] = [ExportError, ModelDirError]
    try:
        from tokembed.client.errors import EmbeddingError

        errors.append(EmbeddingError)
    except ImportError:
        pass
    try:
        from tokembed.server.core.errors import ServerConfigError

        errors.append(ServerConfigError)
    except ImportError:
        pass
    return tuple(errors)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except ModuleNotFoundError as exc:
        line = missing_extra(args.command, exc)
        if line is None:
            raise
        return _one_line_error(args, line)
    except _user_errors() as exc:
        return _one_line_error(args, str(exc))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`tokembed embed ... | head`): nothing more to say. Point
        # stdout at /dev/null so that the interpreter's own flush at exit does not fail
        # again (Python's documented recipe, "Note on SIGPIPE" in the signal module).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a process ended by SIGPIPE reads to a shell (128 + 13)


def _one_line_error(args: argparse.Namespace, message: str) -> int:
    if getattr(args, "log_level", None) == "debug":
        traceback.print_exc()  # asked for: where it came from, before the line itself
    print(f"tokembed {args.command}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
