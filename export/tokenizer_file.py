"""The model's own tokenizer in its directory: ``tokembed export --tokenizer FILE``.

A Hugging Face ``tokenizer.json`` (what ``tokenizers.Tokenizer.save`` and
``PreTrainedTokenizerFast.save_pretrained`` write) is read with the ``tokenizers``
library first, so a file it cannot load, or whose ids reach past the table, is refused
before anything is written; the export then copies it into the staged directory as
``tokenizer.json`` (``tokenizer_addition``), listed in the manifest's ``files`` with its sha256 (the
loader checks it as it checks the graph) and described by the manifest's ``tokenizer``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from tokembed.export.errors import ExportError
from tokembed.export.hashing import sha256_file
from tokembed.export.manifest import (
    MANIFEST_NAME,
    TOKENIZER_NAME,
    FileEntry,
    Manifest,
    TokenizerSpec,
)

if TYPE_CHECKING:
    from tokembed.export.pipeline import Addition

FLAG = "--tokenizer"


def read_tokenizer(path: Path, max_length: int | None) -> TokenizerSpec:
    """What ``path`` is, as the manifest records it; raises ``ExportError`` naming the
    file when the tokenizers library cannot load it."""
    if max_length is not None and max_length <= 0:
        raise ExportError(f"--tokenizer-max-length must be positive, got {max_length}")
    if not path.is_file():
        raise ExportError(f"{FLAG} {path}: no such file (a Hugging Face tokenizer.json)")
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - both extras that export install it
        raise ExportError(
            f"{FLAG} needs the tokenizers package: pip install 'tokembed[export]'"
        ) from exc
    try:
        tokenizer = Tokenizer.from_file(str(path))
        model = json.loads(path.read_text(encoding="utf-8"))["model"]["type"]
    except Exception as exc:  # the library raises Exception for a file it cannot read
        message = " ".join(str(exc).split())
        raise ExportError(
            f"{FLAG} {path}: not a tokenizer.json the tokenizers library can load ({message})"
        ) from exc
    return TokenizerSpec(
        file=TOKENIZER_NAME,
        model=str(model),
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        max_length=max_length,
    )


def tokenizer_addition(path: Path, spec: TokenizerSpec) -> Addition:
    """The tokenizer at ``path`` copied into the model's staging directory and recorded
    in its manifest, as the pipeline's ``Addition`` (hashed with the other files and
    written once with them)."""

    def add(directory: Path, manifest: Manifest) -> Manifest:
        check_fits(path, spec, manifest)
        shutil.copyfile(path, directory / spec.file)
        return dataclasses.replace(manifest, tokenizer=spec)

    return add


def check_fits(path: Path, spec: TokenizerSpec, manifest: Manifest) -> None:
    """The tokenizer's ids are rows of the model's table."""
    if spec.vocab_size > manifest.vocab_size:
        raise ExportError(
            f"{FLAG} {path}: its ids reach {spec.vocab_size - 1}, past the table's "
            f"{manifest.vocab_size} rows (vocab_size); nothing was written"
        )


def attach_tokenizer(out_dir: Path, path: Path, spec: TokenizerSpec) -> Manifest:
    """Copy the tokenizer at ``path`` into the model directory ``out_dir``, already
    published, and record it in the manifest (rewritten in one rename: a reader sees the
    old manifest or the new one, each describing files that are there): for the bench's
    fixtures. The exporter stages it instead (``tokenizer_addition``)."""
    manifest = Manifest.read(out_dir)
    check_fits(path, spec, manifest)
    target = out_dir / spec.file
    staged = out_dir / f".{spec.file}.staging"
    shutil.copyfile(path, staged)
    os.replace(staged, target)
    files = dict(manifest.files)
    files[spec.file] = FileEntry(sha256=sha256_file(target), size_bytes=target.stat().st_size)
    updated = dataclasses.replace(manifest, files=files, tokenizer=spec)
    staged_manifest = out_dir / f".{MANIFEST_NAME}.staging"
    staged_manifest.write_text(updated.to_json(), encoding="utf-8")
    os.replace(staged_manifest, out_dir / MANIFEST_NAME)
    return updated
