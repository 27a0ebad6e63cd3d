"""Where ``tokembed export``'s weights come from: a seeded random model of a kind, or a
checkpoint's tensors at the keys given; each made into its kind's part (``parts``) and
exported (``pipeline.export``), with the manifest's account of its source.

From a checkpoint, the token kind's table is streamed from the open file while the
export runs (``parts.TokenPart``); the other kinds' tables are read whole. Their scale
and padding id follow the flags and the ``config.json`` beside the checkpoint
(``config_flags``).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from tokembed.export.checkpoint_files import CheckpointMatrix
from tokembed.export.cli import DEFAULT_FACTOR_DIM, DEFAULT_TYPE_VOCAB_SIZE, check_padding
from tokembed.export.config_flags import as_configured
from tokembed.export.errors import ExportError
from tokembed.export.hashing import sha256_file
from tokembed.export.kinds import FACTORIZED, SEGMENT, TOKEN
from tokembed.export.manifest import Manifest
from tokembed.export.modules import (
    FactorizedEmbedding,
    SegmentEmbedding,
    TokenEmbedding,
    random_table,
    resolve_scale,
)
from tokembed.export.parts import FactorizedPart, Part, SegmentPart, TokenPart
from tokembed.export.pipeline import ExportOptions, export, export_model
from tokembed.export.weights import find_tie, load_matrix, load_vector, open_matrix

# A kind's scale when neither the flags nor the checkpoint's config.json say: the
# original Transformer's sqrt(D) for a token model; BERT's and ALBERT's 1 for theirs.
DEFAULT_SCALES = {TOKEN: "sqrt", SEGMENT: "none", FACTORIZED: "none"}


def export_random(
    args: argparse.Namespace, kind: str, vocab_size: int, d_model: int, options: ExportOptions
) -> Manifest:
    """A seeded random model of ``kind``, ``[V, D]`` (``--seed``, ``--scale``,
    ``--padding-idx``, ``--type-vocab-size``, ``--factor-dim``)."""
    scale = args.scale if args.scale is not None else DEFAULT_SCALES[kind]
    padding_idx = args.padding_idx
    module: TokenEmbedding | SegmentEmbedding | FactorizedEmbedding
    generator = torch.Generator().manual_seed(args.seed + 1)
    if kind == TOKEN:
        words = _random_table(vocab_size, d_model, args.seed, padding_idx)
        module = TokenEmbedding(vocab_size, d_model, scale, padding_idx, weight=words)
    elif kind == SEGMENT:
        words = _random_table(vocab_size, d_model, args.seed, padding_idx)
        types = args.type_vocab_size or DEFAULT_TYPE_VOCAB_SIZE
        segment = torch.randn(types, d_model, generator=generator)
        module = SegmentEmbedding(words, segment, scale, padding_idx)
    else:
        inner = args.factor_dim or DEFAULT_FACTOR_DIM
        words = _random_table(vocab_size, inner, args.seed, padding_idx)
        # A Linear's own initialisation: uniform in +-1/sqrt(D'), weight and bias.
        bound = inner**-0.5
        projection = (torch.rand(d_model, inner, generator=generator) * 2 - 1) * bound
        bias = (torch.rand(d_model, generator=generator) * 2 - 1) * bound
        module = FactorizedEmbedding(words, projection, bias, scale, padding_idx)
    source = {"kind": "random", "seed": args.seed, "init": "normal(0,1)"}
    return export_model(module, dataclasses.replace(options, source=source))


def _random_table(vocab_size: int, width: int, seed: int, padding_idx: int | None) -> torch.Tensor:
    try:
        return random_table(vocab_size, width, seed, padding_idx)
    except (RuntimeError, MemoryError) as exc:
        # An impossible V x D fails here, in torch's allocator: a bad input, not a bug.
        raise ExportError(
            f"cannot allocate a [{vocab_size}, {width}] float32 table "
            f"({vocab_size * width * 4 / 2**30:,.1f} GiB): out of memory"
        ) from exc


def export_checkpoint(args: argparse.Namespace, kind: str, options: ExportOptions) -> Manifest:
    """The model of ``kind`` at ``--key`` (and the kind's other keys) in ``--weights``: the
    checkpoint is opened and its tensors checked first, then hashed and exported."""
    with open_matrix(args.weights, args.key) as matrix:
        vocab_size, width = matrix.shape
        for flag, given, actual in (
            ("--vocab-size", args.vocab_size, vocab_size),
            # A factorized table's width is D', not D: its projection says D.
            ("--d-model", args.d_model, None if kind == FACTORIZED else width),
        ):
            if given is not None and actual is not None and given != actual:
                raise ExportError(f"{flag} {given} disagrees with the checkpoint's {actual}")
        check_padding(args.padding_idx, vocab_size)
        dtype_name = str(matrix.dtype).removeprefix("torch.")
        scale, padding_idx = as_configured(args, matrix.shape, dtype_name, DEFAULT_SCALES[kind])
        part, keys = _checkpoint_part(args, kind, matrix, scale, padding_idx)
        tie = None
        if args.output_projection is not None:
            tie = find_tie(matrix, args.weights, args.output_projection)
        source = _checkpoint_source(args, matrix, keys)
        return export(part, dataclasses.replace(options, source=source, tie=tie))


def _checkpoint_part(
    args: argparse.Namespace,
    kind: str,
    matrix: CheckpointMatrix,
    scale: float | str,
    padding_idx: int | None,
) -> tuple[Part, dict[str, str]]:
    """The kind's part, and the keys its tensors were read from (for the manifest)."""
    keys = {"key": args.key}
    if kind == TOKEN:
        scale = resolve_scale(scale, matrix.shape[1])
        return TokenPart.of_checkpoint(matrix, scale, padding_idx), keys
    words = load_matrix(args.weights, args.key)
    if kind == SEGMENT:
        keys["segment_key"] = args.segment_key
        segment = load_matrix(args.weights, args.segment_key)
        return SegmentPart(SegmentEmbedding(words, segment, scale, padding_idx)), keys
    keys["projection_key"] = args.projection_key
    projection = load_matrix(args.weights, args.projection_key)
    bias = None
    if args.projection_bias_key is not None:
        keys["projection_bias_key"] = args.projection_bias_key
        bias = load_vector(args.weights, args.projection_bias_key)
    if args.d_model is not None and args.d_model != int(projection.shape[0]):
        raise ExportError(
            f"--d-model {args.d_model} disagrees with the projection's {int(projection.shape[0])}"
        )
    module = FactorizedEmbedding(words, projection, bias, scale, padding_idx)
    return FactorizedPart(module), keys


def _checkpoint_source(
    args: argparse.Namespace, matrix: CheckpointMatrix, keys: dict[str, str]
) -> dict[str, object]:
    source: dict[str, object] = {
        "kind": "checkpoint",
        "file": args.weights.name,
        **keys,
        "sha256": sha256_file(args.weights, label=f"hashing {args.weights.name}"),
    }
    if matrix.index is not None:
        # The index names the shard; the shard holds the bytes.
        source["shard"] = matrix.file.name
        source["shard_sha256"] = sha256_file(matrix.file, label=f"hashing {matrix.file.name}")
    return source
