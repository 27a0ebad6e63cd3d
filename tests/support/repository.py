"""Model repositories for the tests (``DIR/<model>/<version>/``), made of the small model's
versions: each version a copy of a model directory exported once per session, and the
faults a repository meets (a file cut short, a file whose bytes are not those its
manifest's sha256 records, a graph that does not load)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from tokembed.export.manifest import MANIFEST_NAME, MODEL_NAME


def put_version(repository: Path, name: str, version: int, model_dir: Path) -> Path:
    """Copy ``model_dir`` in as ``name``'s version ``version``, the manifest last (as a
    careful copy does: a poller sees the version complete or not at all)."""
    target = repository / name / str(version)
    staging = repository / name / f".{version}.copying"
    shutil.copytree(model_dir, staging, ignore=shutil.ignore_patterns(MANIFEST_NAME))
    shutil.copy2(model_dir / MANIFEST_NAME, staging / MANIFEST_NAME)
    staging.rename(target)
    return target


def half_copied(repository: Path, name: str, version: int, model_dir: Path) -> Path:
    """A version whose largest file (the table's weights) has half its bytes, as a copy
    under way leaves it."""
    target = repository / name / str(version)
    shutil.copytree(model_dir, target)
    largest = max(target.iterdir(), key=lambda path: path.stat().st_size)
    data = largest.read_bytes()
    largest.write_bytes(data[: len(data) // 2])
    return target


def finish_copy(version_dir: Path, model_dir: Path) -> None:
    for path in model_dir.iterdir():
        shutil.copy2(path, version_dir / path.name)


def hash_mismatch(repository: Path, name: str, version: int, model_dir: Path) -> Path:
    """A version whose model.onnx has its recorded size, but not the recorded bytes."""
    target = put_version(repository, name, version, model_dir)
    data = bytearray((target / MODEL_NAME).read_bytes())
    data[-1] ^= 0xFF
    (target / MODEL_NAME).write_bytes(bytes(data))
    return target


def broken_graph(repository: Path, name: str, version: int, model_dir: Path) -> Path:
    """A version whose manifest records its model.onnx exactly, and whose model.onnx is no
    ONNX graph at all."""
    target = put_version(repository, name, version, model_dir)
    junk = b"not an onnx graph" * 64
    (target / MODEL_NAME).write_bytes(junk)
    manifest = json.loads((target / MANIFEST_NAME).read_text())
    manifest["files"][MODEL_NAME] = {
        "sha256": hashlib.sha256(junk).hexdigest(), "size_bytes": len(junk),
    }  # fmt: skip
    (target / MANIFEST_NAME).write_text(json.dumps(manifest))
    return target
