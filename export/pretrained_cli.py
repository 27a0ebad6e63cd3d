"""``tokembed export --from-pretrained DIR``: the flag, what it fills in, and what it
records.

``apply`` turns the directory into the flags a manual export would give (``--weights``,
``--key``, ``--output-projection``), so that the export itself is the checkpoint export
``--weights`` runs (the scale and padding id from config.json, ``architecture.py``; the
tie checked against the values, ``weights.find_tie``). ``record`` adds what was found to
the manifest once the export succeeded.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from tokembed.export.errors import ExportError
from tokembed.export.manifest import MANIFEST_NAME, Manifest, Pretrained
from tokembed.export.pretrained import (
    FLAG,
    Findings,
    convention,
    engine_scales,
    find_pretrained,
)


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        FLAG,
        type=Path,
        default=None,
        metavar="DIR",
        dest="from_pretrained",
        help="a Hugging Face model directory (config.json and its checkpoint, one file or "
        "sharded): its architecture says the table's key, scale, padding id and output "
        "projection, and the served vectors are what its inputs_embeds takes "
        "(docs/export.md lists the architectures)",
    )


def apply(args: argparse.Namespace) -> Findings | None:
    """With ``--from-pretrained``: the findings, and the flags they stand for set on
    ``args``; None without it."""
    if args.from_pretrained is None:
        return None
    given = [flag for flag, value in (
        ("--weights", args.weights), ("--key", args.key),
        ("--output-projection", args.output_projection), ("--segment-key", args.segment_key),
        ("--projection-key", args.projection_key),
        ("--projection-bias-key", args.projection_bias_key), ("--kind", args.kind),
    ) if value is not None]  # fmt: skip
    if given:
        raise ExportError(
            f"{FLAG} finds what {', '.join(given)} would say itself; give one or the other"
        )
    findings = find_pretrained(args.from_pretrained)
    args.weights = findings.checkpoint
    args.key = findings.embedding_key
    args.output_projection = findings.output_projection
    return findings


def record(out: Path, manifest: Manifest, findings: Findings) -> Manifest:
    """The manifest in ``out`` with what ``findings`` say, written in place of the one the
    export wrote (whole, by a rename: a reader sees the one or the other)."""
    pretrained = Pretrained(
        architecture=findings.architecture,
        convention=convention(findings, manifest.scale),
        engine_scales=engine_scales(findings, manifest.scale),
        keys=findings.manifest_record(),
    )
    updated = replace(manifest, pretrained=pretrained)
    staged = out / f".{MANIFEST_NAME}.pretrained"
    staged.write_text(updated.to_json(), encoding="utf-8")
    os.replace(staged, out / MANIFEST_NAME)
    return updated


def describe(manifest: Manifest, findings: Findings) -> list[str]:
    """What the command prints about the findings, a line each."""
    assert manifest.pretrained is not None, "This is a bug: describe() after record()."
    lines = [manifest.pretrained.convention]
    if findings.norm is not None:
        norm = findings.norm
        offset = f", weight + {norm.weight_offset:g}" if norm.weight_offset else ""
        lines.append(f"final norm {norm.key}: {norm.kind}, eps {norm.eps:g}{offset}")
    for what, key in (("segment table", findings.segment_key),
                      ("factorization", findings.projection_key)):  # fmt: skip
        if key is not None:
            lines.append(f"{what} {key}: applied by the model after inputs_embeds, not served")
    return lines
