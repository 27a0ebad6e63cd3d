"""``tokembed export --from-pretrained DIR``: the flag, what it fills in, and what it
records.

``apply`` turns the directory into the flags a manual export would give (``--weights``,
``--key``, ``--output-projection``; the head's ``--output-key``, and ``--norm-*`` where the
head can apply the model's norm as the model does), so that the export itself is the
checkpoint export ``--weights`` runs (the scale and padding id from config.json,
``architecture.py``; the tie checked against the values, ``weights.find_tie``).
``pretrained_addition`` records what was found in the manifest, staged with the rest.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tokembed.export.errors import ExportError
from tokembed.export.manifest import Manifest, Pretrained
from tokembed.export.pretrained import (
    FLAG,
    Findings,
    convention,
    engine_scales,
    find_pretrained,
)

if TYPE_CHECKING:
    from tokembed.export.pipeline import Addition


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
        ("--output-key", args.output_key), ("--tied-head", args.tied_head or None),
        ("--norm-key", args.norm_key), ("--norm-kind", args.norm_kind),
        ("--norm-eps", args.norm_eps), ("--norm-bias-key", args.norm_bias_key),
    ) if value is not None]  # fmt: skip
    if given:
        raise ExportError(
            f"{FLAG} finds what {', '.join(given)} would say itself; give one or the other"
        )
    findings = find_pretrained(args.from_pretrained)
    args.weights = findings.checkpoint
    args.key = findings.embedding_key
    args.output_projection = findings.output_projection
    _apply_head(args, findings)
    return findings


def _apply_head(args: argparse.Namespace, findings: Findings) -> None:
    """The head's flags: the output projection as ``--output-key`` (the exporter's tie
    check then writes the head over the table when it is tied, over this matrix when not)
    and the final norm when the head can apply it as the model does."""
    if findings.output_projection is None:
        return
    args.output_key = findings.output_projection
    norm = findings.norm
    if norm is None or head_norm_left_out(findings) is not None:
        return
    args.norm_key, args.norm_kind, args.norm_eps = norm.key, norm.kind, norm.eps
    args.norm_bias_key = norm.bias_key


def head_norm_left_out(findings: Findings) -> str | None:
    """Why the head is written without the model's final norm, when it is: the head's
    norm multiplies by the weight as stored and its logits are ``norm(h) @ W.T``."""
    norm = findings.norm
    if findings.output_projection is None or norm is None:
        return None
    if norm.weight_offset:
        return f"its {norm.kind} multiplies by ({norm.weight_offset:g} + weight)"
    if findings.output_scale is not None:
        return f"its output is scaled by {findings.output_scale} between the norm and the head"
    return None


def pretrained_addition(findings: Findings) -> Addition:
    """What ``findings`` say, recorded in the manifest as the pipeline's ``Addition``
    (before its one write: a reader never sees the model without it)."""

    def add(directory: Path, manifest: Manifest) -> Manifest:
        pretrained = Pretrained(
            architecture=findings.architecture,
            convention=convention(findings, manifest.scale),
            engine_scales=engine_scales(findings, manifest.scale),
            keys=findings.manifest_record(),
        )
        return replace(manifest, pretrained=pretrained)

    return add


def describe(manifest: Manifest, findings: Findings) -> list[str]:
    """What the command prints about the findings, a line each."""
    assert manifest.pretrained is not None, "This is a bug: describe() of another export."
    lines = [manifest.pretrained.convention]
    if findings.norm is not None:
        norm = findings.norm
        offset = f", weight + {norm.weight_offset:g}" if norm.weight_offset else ""
        lines.append(f"final norm {norm.key}: {norm.kind}, eps {norm.eps:g}{offset}")
    left_out = head_norm_left_out(findings)
    if left_out is not None:
        assert findings.norm is not None
        lines.append(
            f"note: the head is written without the final norm {findings.norm.key} "
            f"({left_out}, which the head's norm does not express): nearest(apply_norm=True) "
            "is refused; give nearest the vectors as the model has them after that step"
        )
    for what, key in (("segment table", findings.segment_key),
                      ("factorization", findings.projection_key)):  # fmt: skip
        if key is not None:
            lines.append(f"{what} {key}: applied by the model after inputs_embeds, not served")
    return lines
