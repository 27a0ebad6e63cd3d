"""``tokembed export``'s flags for the head (vectors back to ids), and their run.

The head is written when the export knows the model's output table (for each kind,
docs/export.md's "The head of each kind"):
- tied: ``--output-projection KEY`` (or ``--output-key KEY``) found to be the exported
  table itself (``weights.find_tie``), or ``--tied-head`` for a seeded random table
  (its own output projection by construction);
- untied: ``--output-key KEY``, a different ``[V, D]`` matrix of the checkpoint (Llama's
  ``lm_head.weight``), read by key.
``--norm-key`` (``--norm-kind``, ``--norm-eps``, ``--norm-bias-key``) adds the model's
final norm before it. A model exported with none of these has no head and refuses the
``nearest`` operation.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from tokembed.export.errors import ExportError
from tokembed.export.manifest import NORM_KINDS, Manifest

if TYPE_CHECKING:
    from tokembed.export.head import NormArrays
    from tokembed.export.pipeline import Addition


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "head (vectors back to ids: `nearest`)",
        "the model's output table, written as head.onnx (MatMul and TopK) beside the "
        "look-up, with its final norm when given",
    )
    group.add_argument(
        "--output-key",
        default=None,
        metavar="KEY",
        help="with --weights: key of the model's output projection (lm_head.weight); tied "
        "to --key, the head reads the exported table (a factorized model: its served "
        "vectors), else this [V,D] matrix",
    )
    group.add_argument(
        "--tied-head",
        action="store_true",
        help="a random (or --builtin) table: write a head over the table itself (a segment "
        "model's word table; a factorized model's served vectors, E P + b of every id)",
    )
    group.add_argument("--norm-key", default=None, metavar="KEY",
                       help="with --weights: key of the final norm's [D] weight")  # fmt: skip
    group.add_argument("--norm-bias-key", default=None, metavar="KEY",
                       help="with --norm-key: key of a LayerNorm's [D] bias")  # fmt: skip
    group.add_argument("--norm-kind", default=None, choices=NORM_KINDS,
                       help="with --norm-key: rmsnorm (Llama) or layernorm (GPT-2)")  # fmt: skip
    group.add_argument("--norm-eps", default=None, type=float, metavar="X",
                       help="with --norm-key: the norm's epsilon (config.json's "
                       "rms_norm_eps or layer_norm_epsilon)")  # fmt: skip


def check_arguments(args: argparse.Namespace) -> None:
    """The head's flags among themselves, before anything is read."""
    if args.output_key is not None and args.weights is None:
        raise ExportError("--output-key needs --weights")
    if args.norm_key is not None and args.weights is None:
        raise ExportError("--norm-key needs --weights")
    if args.tied_head and (args.weights is not None or args.output_key is not None):
        raise ExportError("--tied-head is for a random table; from --weights, give --output-key")
    given = {"--norm-kind": args.norm_kind, "--norm-eps": args.norm_eps,
             "--norm-bias-key": args.norm_bias_key}  # fmt: skip
    if args.norm_key is None:
        extra = [flag for flag, value in given.items() if value is not None]
        if extra:
            raise ExportError(f"{', '.join(extra)} need(s) --norm-key")
        return
    if args.norm_kind is None or args.norm_eps is None:
        raise ExportError("--norm-key needs --norm-kind and --norm-eps")
    if not args.norm_eps > 0:
        raise ExportError(f"--norm-eps must be positive, got {args.norm_eps}")
    if args.norm_bias_key is not None and args.norm_kind != "layernorm":
        raise ExportError("--norm-bias-key is a LayerNorm's: give --norm-kind layernorm")
    if args.output_key is None and args.output_projection is None:
        raise ExportError("--norm-key needs the head's table: --output-key")


def wants_head(args: argparse.Namespace) -> bool:
    return bool(args.tied_head or args.output_key is not None or args.norm_key is not None)


def head_addition(args: argparse.Namespace) -> Addition | None:
    """The head of the model being exported, as the pipeline's ``Addition`` (written in
    the staging directory before the one manifest): tied when the manifest's tie says the
    output projection is the table, else the checkpoint's ``--output-key``. None when the
    flags ask for no head (a tie found without ``--output-key`` still writes one)."""
    if not wants_head(args) and args.output_projection is None:
        return None

    def add(directory: Path, manifest: Manifest) -> Manifest:
        from tokembed.export.head import write_head

        tie = manifest.tie
        if not wants_head(args) and not (tie is not None and tie.tied):
            return manifest
        norm = _norm(args) if args.norm_key is not None else None
        if args.tied_head or (tie is not None and tie.tied):
            key = tie.output_projection if tie is not None else None
            return write_head(directory, manifest, output_table=None, output_key=key,
                              norm=norm, seed=args.seed)  # fmt: skip
        if args.output_key is None:  # a tie was recorded, and it is not one
            assert tie is not None
            raise ExportError(
                f"{tie.output_projection!r} is not tied to {args.key!r} ({tie.evidence}): "
                "give it as --output-key to write the head over it"
            )
        from tokembed.export.weights import load_matrix

        table = load_matrix(args.weights, args.output_key).numpy()
        return write_head(directory, manifest, output_table=table,
                          output_key=args.output_key, norm=norm, seed=args.seed)  # fmt: skip

    return add


def _norm(args: argparse.Namespace) -> NormArrays:
    from tokembed.export.head import NormArrays
    from tokembed.export.manifest import Norm

    record = Norm(args.norm_kind, float(args.norm_eps), args.norm_key, args.norm_bias_key)
    from tokembed.export.weights import load_vector

    weight = load_vector(args.weights, args.norm_key).numpy()
    bias = load_vector(args.weights, args.norm_bias_key).numpy() if args.norm_bias_key else None
    return NormArrays(record, weight, bias)
