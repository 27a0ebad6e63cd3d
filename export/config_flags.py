"""``tokembed export``'s scale and padding id for a checkpoint, as its ``config.json``
decides them (``architecture``), and the notes the command prints on stderr about the
checkpoint once the export succeeded (so that a refusal stays one line): an architecture
it does not know, a half-width table widened to float32."""

from __future__ import annotations

import argparse
import sys

from tokembed.export.architecture import Unknown, architecture_of, settle
from tokembed.export.dtypes import FLOAT32, WEIGHT_DTYPES


def as_configured(
    args: argparse.Namespace, shape: tuple[int, int], table_dtype: str, default_scale: str
) -> tuple[float | str, int | None]:
    """The scale and padding id to export the ``[V, D]`` matrix at ``--key`` (stored in
    ``table_dtype``, a torch dtype's name) with; ``default_scale``: the kind's, used when
    neither the flags nor a known architecture say. Notes go to ``args.notes``."""
    found = architecture_of(args.weights, shape, table_dtype)
    settled = settle(
        found,
        args.scale,
        args.padding_idx,
        override=args.override_config,
        d_model=shape[1],
        default_scale=default_scale,
    )
    if isinstance(found, Unknown) and args.scale is None:
        args.notes.append(
            f"config.json's model_type {found.model_type!r} is not one whose scale tokembed "
            f"knows: exported with scale {default_scale}; give --scale as the model computes it"
        )
    # A checkpoint narrower than float32 that the table could be stored as.
    if table_dtype in WEIGHT_DTYPES and table_dtype != FLOAT32.name and not args.dtype_given:
        args.notes.append(
            f"{args.key!r} is {table_dtype}: stored as float32 (its values exactly, twice the "
            f"bytes); --dtype {table_dtype} keeps it as it is"
        )
    return settled


def print_notes(notes: list[str]) -> None:
    for text in notes:
        print(f"tokembed export: note: {text}", file=sys.stderr)
