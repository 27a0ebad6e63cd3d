"""``tokembed models index|load|unload``: a server's model repository on the command line
(the control token read from ``--control-token-file``, sent in place of the data token)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokembed.client.results import RepositoryModel
    from tokembed.client.sync import EmbeddingClient

LOAD_TIMEOUT_S = 300.0


def run_control(
    args: argparse.Namespace, connect: Callable[[argparse.Namespace], EmbeddingClient]
) -> int:
    from tokembed.client.errors import InvalidInputError

    if args.timeout_s is None:
        args.timeout_s = 10.0 if args.action == "index" else LOAD_TIMEOUT_S
    if args.action != "index" and not args.name:
        raise InvalidInputError(f"tokembed models {args.action} needs the model's name")
    config = _config(args.config) if args.config is not None else None
    token = _control_token(args)
    with connect(args) as client:
        if args.action == "index":
            entries = client.repository_index(control_token=token)
            if args.json:
                print(json.dumps([asdict(entry) for entry in entries], indent=2))
            else:
                print("\n".join(index_table(entries)))
        elif args.action == "load":
            client.load_model(args.name, config=config, force=args.force, control_token=token)
            print(f"loaded {args.name}")
        else:
            client.unload_model(args.name, control_token=token)
            print(f"unloading {args.name}: new requests are refused, admitted ones finish")
    return 0


def index_table(entries: list[RepositoryModel]) -> list[str]:
    header = ("MODEL", "VERSION", "STATE", "REASON")
    rows = [(e.name, e.version or "-", e.state, e.reason) for e in entries]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(3)]
    return [
        "  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)),
                   row[3]]).rstrip()
        for row in (header, *rows)
    ]  # fmt: skip


def _config(text: str) -> dict[str, Any]:
    from tokembed.client.errors import InvalidInputError

    try:
        config = json.loads(text)
    except ValueError as exc:
        raise InvalidInputError(f"--config is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise InvalidInputError(f"--config must be a JSON object, got {text!r}")
    return config


def _control_token(args: argparse.Namespace) -> str | None:
    from tokembed.client.errors import EmbeddingError

    if args.control_token_file is None:
        return None
    try:
        return str(args.control_token_file.read_text().strip())
    except OSError as exc:
        raise EmbeddingError(
            f"cannot read --control-token-file {args.control_token_file}: {exc}"
        ) from exc
