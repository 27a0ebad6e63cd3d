"""Flags and TOKEMBED_* variables from a frozen dataclass's fields: one field, given with
``setting``, is a flag (``--max-delay-ms``), a variable (``TOKEMBED_MAX_DELAY_MS``) and its
``--help`` line. Precedence: the flag, then the variable, then the field's default.
Written over argparse and dataclasses (pydantic-settings would do it): the server carries
no dependency for this alone. What the settings are, and their rules: ``settings``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import field, fields
from pathlib import Path
from typing import Any

from tokembed.server.core.errors import ServerConfigError

ENV_PREFIX = "TOKEMBED_"


def setting(default: Any, help: str, **extra: Any) -> Any:
    """A field that is a flag and a variable: ``help`` its text; ``choices``, and ``many``
    (the flag repeated, the variable comma-separated), in ``extra``."""
    return field(default=default, metadata={"help": help, **extra})


def add_arguments(cls: Any, parser: argparse.ArgumentParser) -> None:
    """A flag on ``parser`` for each of the dataclass ``cls``'s fields."""
    for spec in fields(cls):
        flag = "--" + spec.name.replace("_", "-")
        env = ENV_PREFIX + spec.name.upper()
        kind = _value_type(spec.type)
        parser.add_argument(
            flag,
            dest=spec.name,
            type=kind,
            default=None,
            action="append" if spec.metadata.get("many") else "store",
            choices=spec.metadata.get("choices"),
            metavar=spec.name.upper(),
            # argparse formats help with %: a literal percent sign must be doubled.
            help=f"{spec.metadata['help']} [env {env}; default {shown(spec.default)}]".replace(
                "%", "%%"
            ),
        )


def values_from(cls: Any, args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    """The values given for ``cls``'s fields, by flag (``args``) or variable (``environ``);
    a field given neither way is left out (its default stands)."""
    values: dict[str, Any] = {}
    for spec in fields(cls):
        given = getattr(args, spec.name, None)
        if given is None:
            raw = environ.get(ENV_PREFIX + spec.name.upper())
            if raw is None or raw == "":
                continue
            kind, choices = _value_type(spec.type), spec.metadata.get("choices")
            if spec.metadata.get("many"):
                given = [_parse_env(spec.name, part.strip(), kind, choices)
                         for part in raw.split(",") if part.strip()]  # fmt: skip
            else:
                given = _parse_env(spec.name, raw, kind, choices)
        values[spec.name] = tuple(given) if spec.metadata.get("many") else given
    return values


def shown(default: Any) -> str:
    """A default as the flags take it (nothing given as "unset")."""
    if default is None or default == ():
        return "unset"
    return str(default)


def _value_type(annotation: object) -> Any:
    text = str(annotation)
    if "Path" in text:
        return Path
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str


def _parse_env(name: str, raw: str, kind: Any, choices: Sequence[str] | None) -> Any:
    env = ENV_PREFIX + name.upper()
    try:
        value = kind(raw)
    except ValueError:
        raise ServerConfigError(f"{env}={raw!r} is not a valid {kind.__name__}") from None
    if choices is not None and value not in choices:
        raise ServerConfigError(f"{env}={raw!r} is not one of {list(choices)}")
    return value
