"""``tokembed <subcommand>``: dispatch to the room that owns each subcommand.

Each room registers its own parser; imports are deferred so that ``tokembed embed``
never loads torch and ``tokembed export`` never loads grpc's server.
A domain error becomes one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from tokembed import __version__

# module that provides add_parser(subparsers), in the order --help lists them
_SUBCOMMAND_MODULES = (
    "tokembed.export.cli",
    "tokembed.export.triton",
    "tokembed.server.cli",
    "tokembed.cli.client",
    "tokembed.bench.cli",
)


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
    except _user_errors() as exc:
        if getattr(args, "log_level", None) == "debug":
            traceback.print_exc()  # asked for: where it came from, before the line itself
        print(f"tokembed {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`tokembed embed ... | head`): nothing more to say. Point
        # stdout at /dev/null so that the interpreter's own flush at exit does not fail
        # again (Python's documented recipe, "Note on SIGPIPE" in the signal module).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a process ended by SIGPIPE reads to a shell (128 + 13)


if __name__ == "__main__":
    sys.exit(main())
