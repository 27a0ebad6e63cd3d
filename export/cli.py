"""``tokembed export``: the command line of the exporter, one command for every model kind.

From a checkpoint, the kind follows from the keys given beside ``--key`` (the word
embeddings): ``--segment-key`` (BERT's ``token_type_embeddings``) makes a segment model,
``--projection-key`` (ALBERT's ``embedding_hidden_mapping_in``, with
``--projection-bias-key`` for its bias) a factorized one. Without a checkpoint, ``--kind``
with ``--type-vocab-size`` or ``--factor-dim`` makes a seeded random one.

The flags are checked here, before torch is imported; ``sources`` then makes the kind's
part (``parts``) from the checkpoint or the seed, and ``pipeline.export`` exports it.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tokembed.export import head_cli, pretrained_cli
from tokembed.export.architecture import OVERRIDE_FLAG
from tokembed.export.checkpoint_dir import checkpoint_in
from tokembed.export.config_flags import print_notes
from tokembed.export.dtypes import WEIGHT_DTYPES
from tokembed.export.errors import ExportError
from tokembed.export.kinds import FACTORIZED, KINDS, SEGMENT, TOKEN
from tokembed.export.manifest import TOKENIZER_NAME, Manifest
from tokembed.export.naming import model_name_for
from tokembed.export.out_dir import check_out_dir

DEFAULT_VOCAB_SIZE = 32000
DEFAULT_D_MODEL = 512
DEFAULT_SEED = 0
DEFAULT_TYPE_VOCAB_SIZE = 2  # BERT's
DEFAULT_FACTOR_DIM = 128  # ALBERT's embedding_size


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "export",
        help="turn a token-embedding layer into a verified ONNX model directory",
        description=(
            "Export a token-embedding layer (seeded random, or a matrix from a checkpoint) "
            "to DIR/model.onnx + manifest.json, after proving that onnxruntime computes "
            "exactly what torch computes."
        ),
    )
    parser.add_argument("--out", required=True, type=Path, help="model directory to write")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"V, rows of the table (default {DEFAULT_VOCAB_SIZE}; "
        "taken from the checkpoint with --weights)",
    )
    parser.add_argument(
        "--d-model",
        type=int,
        default=None,
        help=f"D, width of the table (default {DEFAULT_D_MODEL}; "
        "taken from the checkpoint with --weights)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        help="seed of the random table and of the parity check (default 0)",
    )
    parser.add_argument(
        "--weights",
        type=Path,
        default=None,
        help="checkpoint: a torch state_dict (.pt/.pth/.bin), .safetensors, or a sharded "
        "checkpoint's *.safetensors.index.json / pytorch_model.bin.index.json (only the "
        "shard holding --key is read), or the directory transformers saved it in; the "
        "config.json beside it decides the default --scale and --padding-idx",
    )
    parser.add_argument("--key", default=None, help="key of the [V,D] matrix in --weights")
    parser.add_argument(
        "--output-projection",
        default=None,
        metavar="KEY",
        help="key of the model's output projection in --weights (lm_head.weight): whether it "
        "is tied to --key, and how that is known, is recorded in the manifest",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=list(WEIGHT_DTYPES),
        help="storage dtype of the table: float16 and bfloat16 take half the bytes (float16 "
        "must hold the table's largest value; bfloat16 has float32's range and 8 bits of "
        "precision, and keeps a bfloat16 checkpoint exactly). Default float32. Answers are "
        "float32 unless a request asks for another dtype",
    )
    parser.add_argument(
        "--scale",
        default=None,
        help="'sqrt' (sqrt(D)), 'none' (1.0) or a positive number. Default: what the "
        "architecture in the config.json beside --weights computes; else sqrt for a token "
        "model, none for the segment and factorized kinds",
    )
    parser.add_argument(
        "--padding-idx",
        type=int,
        default=None,
        help="padding id: its row starts as zeros (random init) and is recorded (default: "
        "config.json's pad_token_id, beside --weights)",
    )
    parser.add_argument(
        OVERRIDE_FLAG,
        action="store_true",
        help="export the --scale and --padding-idx given even where they contradict what "
        "the architecture in config.json beside --weights computes",
    )
    parser.add_argument(
        "--name",
        default=None,
        help="model name in the manifest, which the server serves it under (default: the "
        "name of --out; for a model repository's <model>/<version> layout, <model>)",
    )
    parser.add_argument("--model-version", default="1", help="model version in the manifest")
    parser.add_argument(
        "--force", action="store_true", help="overwrite --out even if it is not empty"
    )
    parser.add_argument(
        "--builtin",
        action="store_true",
        help="write the built-in default model (V=32000, D=512, seed 0, tokembed-default), "
        "the one `tokembed serve` builds when given no model; needs no torch, and takes "
        "no other option but --out",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="FILE",
        help="the model's Hugging Face tokenizer.json: copied into the directory, hashed "
        "with its other files and recorded in the manifest, so that the server tokenizes "
        "text for it (Tokenize, Detokenize, EmbedText); its ids must be rows of the table",
    )
    parser.add_argument(
        "--tokenizer-max-length",
        type=int,
        default=None,
        metavar="N",
        help="the longest text, in tokens, the model takes (its positions): a longer one is "
        "refused, or truncated when the request asks (default: the server's per-request limit)",
    )
    pretrained_cli.add_argument(parser)
    _add_kind_arguments(parser)
    head_cli.add_arguments(parser)
    parser.set_defaults(run=run)


def _add_kind_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "model kinds",
        "BERT's segment embeddings (E[id]*scale + S[type]) and ALBERT's factorized ones "
        "(E [V,D'] projected to D); the scale defaults to none (1) for both, as in those models",
    )
    group.add_argument(
        "--segment-key",
        default=None,
        metavar="KEY",
        help="with --weights: key of the [T,D] token type table (BERT: "
        "embeddings.token_type_embeddings.weight): a segment model",
    )
    group.add_argument(
        "--projection-key",
        default=None,
        metavar="KEY",
        help="with --weights: key of the [D,D'] Linear weight projecting the [V,D'] table "
        "to D (ALBERT: encoder.embedding_hidden_mapping_in.weight): a factorized model",
    )
    group.add_argument(
        "--projection-bias-key",
        default=None,
        metavar="KEY",
        help="with --projection-key: key of its [D] bias (ALBERT: "
        "encoder.embedding_hidden_mapping_in.bias)",
    )
    group.add_argument(
        "--kind",
        default=None,
        choices=sorted(KINDS),
        help="without --weights: the kind of the seeded random model (default token)",
    )
    group.add_argument(
        "--type-vocab-size",
        type=int,
        default=None,
        metavar="T",
        help=f"--kind segment: token types (default {DEFAULT_TYPE_VOCAB_SIZE})",
    )
    group.add_argument(
        "--factor-dim",
        type=int,
        default=None,
        metavar="D'",
        help=f"--kind factorized: width of the table before the projection (default "
        f"{DEFAULT_FACTOR_DIM})",
    )


def run(args: argparse.Namespace) -> int:
    """Export; a bad input is reported as one line (by the caller) via ExportError."""
    # Left out, --dtype is float32; a checkpoint in another one is then told so.
    args.dtype_given, args.dtype = args.dtype is not None, args.dtype or "float32"
    # What the export has to say beside its result, printed once it succeeded.
    args.notes = []
    if args.builtin:
        return _builtin(args)
    if args.tokenizer is None and args.from_pretrained is not None:
        beside = args.from_pretrained / TOKENIZER_NAME
        if beside.is_file():  # a Hugging Face model directory's own tokenizer comes with it
            args.tokenizer = beside
    args.tokenizer_spec = None
    if args.tokenizer is not None:
        from tokembed.export.tokenizer_file import read_tokenizer

        args.tokenizer_spec = read_tokenizer(args.tokenizer, args.tokenizer_max_length)
    elif args.tokenizer_max_length is not None:
        raise ExportError("--tokenizer-max-length needs --tokenizer")
    return _export(args)


def _export(args: argparse.Namespace) -> int:
    """The model itself, as the flags ask."""
    # A Hugging Face model directory: the flags it stands for (--weights, --key, ...).
    findings = pretrained_cli.apply(args)
    # Flags that need no checkpoint are checked before torch is imported: a mistyped
    # command then answers at once instead of after a second of imports.
    if args.key is not None and args.weights is None:
        raise ExportError("--key needs --weights")
    if args.weights is not None and args.key is None:
        raise ExportError("--weights needs --key (the name of the [V,D] matrix)")
    if args.output_projection is not None and args.weights is None:
        raise ExportError("--output-projection needs --weights")
    if args.override_config and args.weights is None:
        raise ExportError(f"{OVERRIDE_FLAG} needs --weights (it overrides their config.json's)")
    head_cli.check_arguments(args)
    if args.weights is not None:
        args.weights = checkpoint_in(args.weights)
    # torch's and numpy's generators both take seeds in [0, 2**64); outside it they raise
    # ValueError deep inside the export, which would surface as a traceback.
    if not 0 <= args.seed < 2**64:
        raise ExportError(f"--seed must be in [0, 2**64), got {args.seed}")
    kind = _kind_asked(args)
    # Before loading and hashing a checkpoint that may be many GB, not after.
    check_out_dir(args.out, args.force)
    name = args.name if args.name is not None else model_name_for(args.out)
    if args.weights is None:
        vocab_size = args.vocab_size if args.vocab_size is not None else DEFAULT_VOCAB_SIZE
        d_model = args.d_model if args.d_model is not None else DEFAULT_D_MODEL
        _check_positive("--vocab-size", vocab_size)
        _check_positive("--d-model", d_model)
        check_padding(args.padding_idx, vocab_size)

    # Imported here: `tokembed --help` and the other subcommands must not pay for torch.
    # Without it (a server-only install), cli/main.py says which extra to install.
    from tokembed.export import sources
    from tokembed.export.pipeline import ExportOptions

    logging.getLogger("tokembed").setLevel(logging.INFO)
    # What the export adds beside the model, staged with it before its one manifest.
    additions = []
    head = head_cli.head_addition(args)
    if head is not None:
        additions.append(head)
    if findings is not None:
        additions.append(pretrained_cli.pretrained_addition(findings))
    tokenizer = args.tokenizer_spec
    if tokenizer is not None:
        from tokembed.export.tokenizer_file import tokenizer_addition

        additions.append(tokenizer_addition(args.tokenizer, tokenizer))
    options = ExportOptions(
        out_dir=args.out,
        name=name,
        version=args.model_version,
        weight_dtype=args.dtype,
        force=args.force,
        seed=args.seed,
        additions=tuple(additions),
    )
    if args.weights is None:
        manifest = sources.export_random(args, kind, vocab_size, d_model, options)
    else:
        manifest = sources.export_checkpoint(args, kind, options)
    _print_exported(manifest, args.out)
    if manifest.head is not None:
        head_record = manifest.head
        print(f"head: {head_record.graph} over the {head_record.table} table"
              + (f", after its {head_record.norm.kind}" if head_record.norm is not None else "")
              + f", max_abs_error={head_record.parity.max_abs_error:g}")  # fmt: skip
    if findings is not None:
        print("\n".join(pretrained_cli.describe(manifest, findings)))
    if tokenizer is not None:
        limit = "" if tokenizer.max_length is None else f", max_length {tokenizer.max_length}"
        print(f"tokenizer {tokenizer.model}, {tokenizer.vocab_size} ids{limit} -> "
              f"{args.out / tokenizer.file}")  # fmt: skip
    print_notes(args.notes)
    return 0


def _kind_asked(args: argparse.Namespace) -> str:
    """The kind the flags ask for (``ExportError`` for flags that do not go together)."""
    if args.projection_bias_key is not None and args.projection_key is None:
        raise ExportError("--projection-bias-key needs --projection-key")
    if args.weights is not None:
        if args.kind is not None:
            raise ExportError(
                "--kind is for random models; with --weights the keys say the kind "
                "(--segment-key: segment, --projection-key: factorized)"
            )
        if args.segment_key is not None and args.projection_key is not None:
            raise ExportError("--segment-key and --projection-key make different kinds; give one")
        for flag, given in (("--type-vocab-size", args.type_vocab_size),
                            ("--factor-dim", args.factor_dim)):  # fmt: skip
            if given is not None:
                raise ExportError(f"{flag} is for random models; with --weights the checkpoint "
                                  "gives it")  # fmt: skip
        if args.segment_key is not None:
            return SEGMENT
        return FACTORIZED if args.projection_key is not None else TOKEN
    for flag, given in (("--segment-key", args.segment_key),
                        ("--projection-key", args.projection_key)):  # fmt: skip
        if given is not None:
            raise ExportError(f"{flag} needs --weights")
    kind = args.kind or TOKEN
    if args.type_vocab_size is not None and kind != SEGMENT:
        raise ExportError("--type-vocab-size is for --kind segment")
    if args.factor_dim is not None and kind != FACTORIZED:
        raise ExportError("--factor-dim is for --kind factorized")
    for flag, value in (("--type-vocab-size", args.type_vocab_size),
                        ("--factor-dim", args.factor_dim)):  # fmt: skip
        if value is not None and value <= 0:
            raise ExportError(f"{flag} must be positive, got {value}")
    return kind


def _print_exported(manifest: Manifest, out: Path) -> None:
    """The export's result on stdout: the model (a kind other than token named, with its
    sizes), its parity (the bound where it is not 0), and its tie when asked."""
    kind = "" if manifest.kind == TOKEN else f" ({manifest.kind})"
    sizes = "".join(
        f" {label}={size}"
        for label, size in (("T", manifest.type_vocab_size), ("D'", manifest.factor_dim))
        if size is not None
    )
    parity = manifest.parity
    bound = f" (bound {parity.tolerance:g})" if parity.tolerance != 0 else ""
    print(
        f"exported {manifest.name} v{manifest.version}{kind}: V={manifest.vocab_size} "
        f"D={manifest.d_model}{sizes} scale={manifest.scale:g} weights={manifest.weight_dtype} "
        f"max_abs_error={parity.max_abs_error:g}{bound} -> {out}"
    )
    if manifest.tie is not None:
        tie = manifest.tie
        state = "tied to" if tie.tied else "not tied to"
        print(f"{state} the output projection {tie.output_projection} ({tie.evidence})")


def _builtin(args: argparse.Namespace) -> int:
    """``--builtin``: the server's own default model, built as ``tokembed serve`` builds it."""
    from tokembed.export.builtin import DEFAULT, build_builtin_model

    others = [flag for flag, given in (
        ("--weights", args.weights), ("--key", args.key),
        ("--from-pretrained", args.from_pretrained), ("--vocab-size", args.vocab_size),
        ("--d-model", args.d_model), ("--padding-idx", args.padding_idx), ("--name", args.name),
        ("--force", args.force or None), ("--segment-key", args.segment_key),
        (OVERRIDE_FLAG, args.override_config or None),
        ("--projection-key", args.projection_key), ("--kind", args.kind),
        ("--type-vocab-size", args.type_vocab_size), ("--factor-dim", args.factor_dim),
        ("--output-key", args.output_key), ("--norm-key", args.norm_key),
        ("--tokenizer", args.tokenizer), ("--tokenizer-max-length", args.tokenizer_max_length),
    ) if given is not None]  # fmt: skip
    # Flags with a default: refused when they ask for another model than the built-in one
    # (its seed 0, float32, sqrt(D), version 1), not silently ignored.
    others += [flag for flag, differs in (
        ("--seed", args.seed != DEFAULT.seed), ("--dtype", args.dtype != "float32"),
        ("--scale", args.scale not in (None, "sqrt")),
        ("--model-version", args.model_version != DEFAULT.version),
    ) if differs]  # fmt: skip
    if others:
        raise ExportError(f"--builtin takes no {', '.join(others)}: its model is fixed")

    check_out_dir(args.out, args.force)
    head = head_cli.head_addition(args)
    build_builtin_model(args.out, additions=() if head is None else (head,))
    print(f"built the built-in default model -> {args.out}")
    if head is not None:
        print("head: head.onnx over the embedding table")
    return 0


def _check_positive(flag: str, value: int) -> None:
    if value <= 0:
        raise ExportError(f"{flag} must be positive, got {value}")


def check_padding(padding_idx: int | None, vocab_size: int) -> None:
    """``--padding-idx`` is a row of the table."""
    if padding_idx is not None and not 0 <= padding_idx < vocab_size:
        raise ExportError(f"--padding-idx {padding_idx} is outside [0, {vocab_size})")
