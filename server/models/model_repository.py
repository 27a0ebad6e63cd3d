"""A model repository on disk, as Triton lays one out: ``DIR/<model>/<version>/``, each
version directory an exported model directory (``tokembed export``), versions positive
integers. The model's name and version are the directories' (the manifest's are logged
when they differ, as Triton's layout decides).

What is read here, and nothing more: which models and versions are on disk, which of
them a model's version policy chooses, whether a version's files are all there (a
version still being copied is not one to load yet), and a signature of its files that
tells a changed version from an unchanged one without reading them. The load itself
(and the sha256 of every file) is ``loading``'s; when to load is the control plane's.

A model's version policy is Triton's: ``{"latest": {"num_versions": N}}``, ``{"all":
{}}`` or ``{"specific": {"versions": [1, 3]}}``, from ``DIR/<model>/config.json``'s
``version_policy`` when it has one (else the latest version alone), or from a load's
``config``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokembed.export.errors import ModelDirError
from tokembed.export.manifest import MANIFEST_NAME, Manifest
from tokembed.server.core.errors import InvalidInput

CONFIG_NAME = "config.json"
# What a load's ``config`` (or a model's config.json) may set: the rest of Triton's model
# configuration describes what tokembed reads from the manifest, or does not do.
OVERRIDABLE = ("name", "version_policy")


@dataclass(frozen=True)
class VersionPolicy:
    """Which of a model's versions are served: the ``count`` latest, all, or ``versions``."""

    kind: str  # "latest", "all" or "specific"
    count: int = 1
    versions: tuple[int, ...] = ()

    def choose(self, available: list[int]) -> list[int]:
        ordered = sorted(available)
        if self.kind == "all":
            return ordered
        if self.kind == "specific":
            return [v for v in ordered if v in self.versions]
        return ordered[-self.count :]

    def describe(self) -> str:
        if self.kind == "all":
            return "all versions"
        if self.kind == "specific":
            return "versions " + ", ".join(str(v) for v in self.versions)
        return f"the latest {self.count}"


LATEST_ONE = VersionPolicy("latest", 1)


def version_policy(value: Any, where: str) -> VersionPolicy:
    """A ``version_policy`` as Triton's model configuration writes it in JSON;
    ``InvalidInput`` naming ``where`` and the bad value otherwise."""
    if not isinstance(value, Mapping) or len(value) != 1:
        raise InvalidInput(
            f'{where}: version_policy must be one of {{"latest": {{"num_versions": N}}}}, '
            f'{{"all": {{}}}}, {{"specific": {{"versions": [...]}}}}; got {value!r}'
        )
    ((kind, body),) = value.items()
    body = body if isinstance(body, Mapping) else {}
    if kind == "all":
        return VersionPolicy("all")
    if kind == "latest":
        count = body.get("num_versions", 1)
        if isinstance(count, str) and count.isdigit():  # protobuf's JSON writes int64 so
            count = int(count)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise InvalidInput(f"{where}: latest.num_versions must be >= 1, got {count!r}")
        return VersionPolicy("latest", count)
    if kind == "specific":
        versions = body.get("versions")
        if (
            not isinstance(versions, list)
            or not versions
            or not all(_version_number(v) is not None for v in versions)
        ):
            raise InvalidInput(
                f"{where}: specific.versions must be a list of positive integers, got {versions!r}"
            )
        return VersionPolicy("specific", versions=tuple(sorted(_version_number(v) or 0
                                                                for v in versions)))  # fmt: skip
    raise InvalidInput(
        f"{where}: version_policy {kind!r} is not one of 'latest', 'all', 'specific'"
    )


def _version_number(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and value > 0:
        return value
    if isinstance(value, str) and value.isdigit() and int(value) > 0:
        return int(value)
    return None


def check_config(name: str, config: Mapping[str, Any], where: str) -> VersionPolicy | None:
    """The version policy ``config`` sets (None: it sets none); ``InvalidInput`` for what
    cannot be honoured, naming it."""
    refused = sorted(set(config) - set(OVERRIDABLE))
    if refused:
        raise InvalidInput(
            f"{where}: cannot override {', '.join(repr(key) for key in refused)} of model "
            f"{name!r}; a load's config may set only {', '.join(OVERRIDABLE)} (the rest is "
            "the model directory's manifest)"
        )
    if "name" in config and config["name"] != name:
        raise InvalidInput(f"{where}: name {config['name']!r} differs from the model's, {name!r}")
    if "version_policy" in config:
        return version_policy(config["version_policy"], where)
    return None


@dataclass(frozen=True)
class VersionOnDisk:
    number: int
    path: Path
    # Why it is not one to load yet (files still being copied), or "".
    incomplete: str
    # The manifest's bytes and each of its files' (name, size, mtime): equal signatures
    # are an unchanged version, without reading its files.
    signature: tuple[object, ...]


class ModelRepositoryDir:
    def __init__(self, root: Path) -> None:
        self.root = root

    def models(self) -> list[str]:
        """The models on disk: the sub-directories of the repository, by name."""
        try:
            return sorted(
                entry.name for entry in os.scandir(self.root)
                if entry.is_dir() and not entry.name.startswith(".")
            )  # fmt: skip
        except OSError:
            return []

    def has(self, name: str) -> bool:
        return "/" not in name and name not in ("", ".", "..") and (self.root / name).is_dir()

    def versions(self, name: str) -> list[VersionOnDisk]:
        """``name``'s version directories (positive integers), in order."""
        directory = self.root / name
        found = []
        try:
            entries = list(os.scandir(directory))
        except OSError:
            return []
        for entry in entries:
            number = _version_number(entry.name)
            if number is None or not entry.is_dir() or str(number) != entry.name:
                continue
            path = Path(entry.path)
            incomplete, signature = _read_version(path)
            found.append(VersionOnDisk(number, path, incomplete, signature))
        return sorted(found, key=lambda version: version.number)

    def policy(self, name: str) -> VersionPolicy:
        """``name``'s version policy from its config.json, else the latest version alone;
        ``InvalidInput`` for a config.json that cannot be honoured."""
        path = self.root / name / CONFIG_NAME
        if not path.is_file():
            return LATEST_ONE
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise InvalidInput(f"{path}: not valid JSON: {exc}") from exc
        if not isinstance(config, Mapping):
            raise InvalidInput(f"{path}: must hold a JSON object, got {type(config).__name__}")
        return check_config(name, config, str(path)) or LATEST_ONE


def _read_version(path: Path) -> tuple[str, tuple[object, ...]]:
    """Whether the version in ``path`` has all its files (sizes as its manifest records;
    their sha256 is the load's to check), and its signature."""
    manifest_path = path / MANIFEST_NAME
    try:
        manifest_bytes = manifest_path.read_bytes()
    except OSError:
        return f"no {MANIFEST_NAME} in {path} yet", ()
    try:
        manifest = Manifest.read(path)
    except (ModelDirError, ValueError, KeyError, TypeError) as exc:
        return f"{manifest_path} is not complete: {exc}", (manifest_bytes,)
    signature: list[object] = [manifest_bytes]
    for file_name, entry in sorted(manifest.files.items()):
        try:
            stat = (path / file_name).stat()
        except OSError:
            return f"{path / file_name} is not there yet", tuple(signature)
        if stat.st_size != entry.size_bytes:
            return (
                f"{path / file_name} has {stat.st_size} of the {entry.size_bytes} bytes its "
                "manifest records (still being copied, or cut short)",
                tuple(signature),
            )
        signature.append((file_name, stat.st_size, stat.st_mtime_ns))
    return "", tuple(signature)
