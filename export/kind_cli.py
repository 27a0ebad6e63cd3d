"""``tokembed export``'s flags for the segment and factorized kinds, and their run.

From a checkpoint, the kind follows from the keys given beside ``--key`` (the word
embeddings): ``--segment-key`` (BERT's ``token_type_embeddings``) makes a segment model,
``--projection-key`` (ALBERT's ``embedding_hidden_mapping_in``, with
``--projection-bias-key`` for its bias) a factorized one. Without a checkpoint,
``--kind`` with ``--type-vocab-size`` or ``--factor-dim`` makes a seeded random one.
"""

from __future__ import annotations

import argparse
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from tokembed.export.errors import CheckpointError, ExportError
from tokembed.export.kinds import FACTORIZED, KINDS, SEGMENT, TOKEN

if TYPE_CHECKING:
    import torch

    from tokembed.export.kind_export import KindModule

DEFAULT_TYPE_VOCAB_SIZE = 2  # BERT's
DEFAULT_FACTOR_DIM = 128  # ALBERT's embedding_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
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


def kind_asked(args: argparse.Namespace) -> str:
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


def run(
    args: argparse.Namespace, kind: str, name: str, random_sizes: tuple[int, int] | None
) -> int:
    """Export a segment or factorized model (torch imported by the caller's check).
    ``random_sizes``: V and D of a random model (None with --weights)."""
    from tokembed.export.hashing import sha256_file
    from tokembed.export.kind_export import export_kind_model
    from tokembed.export.kind_modules import FactorizedEmbedding, SegmentEmbedding
    from tokembed.export.onnx_export import ExportOptions

    scale: float | str = args.scale if args.scale is not None else "none"
    padding_idx = args.padding_idx
    module: KindModule
    if args.weights is not None:
        from tokembed.export.config_flags import as_configured
        from tokembed.export.weights import load_matrix, open_matrix

        with open_matrix(args.weights, args.key) as matrix:
            shape, stored = matrix.shape, str(matrix.dtype).removeprefix("torch.")
        scale, padding_idx = as_configured(args, shape, stored, "none")
        words = load_matrix(args.weights, args.key)
        for flag, given, actual in (
            ("--vocab-size", args.vocab_size, int(words.shape[0])),
            ("--d-model", args.d_model, None if kind == FACTORIZED else int(words.shape[1])),
        ):
            if given is not None and actual is not None and given != actual:
                raise ExportError(f"{flag} {given} disagrees with the checkpoint's {actual}")
        keys = {"key": args.key}
        if kind == SEGMENT:
            keys["segment_key"] = args.segment_key
            segment = load_matrix(args.weights, args.segment_key)
            module = SegmentEmbedding(words, segment, scale, padding_idx)
        else:
            keys["projection_key"] = args.projection_key
            projection = load_matrix(args.weights, args.projection_key)
            bias = None
            if args.projection_bias_key is not None:
                keys["projection_bias_key"] = args.projection_bias_key
                bias = load_vector(args.weights, args.projection_bias_key)
            if args.d_model is not None and args.d_model != int(projection.shape[0]):
                raise ExportError(
                    f"--d-model {args.d_model} disagrees with the projection's "
                    f"{int(projection.shape[0])}"
                )
            module = FactorizedEmbedding(words, projection, bias, scale, padding_idx)
        source: dict[str, object] = {
            "kind": "checkpoint",
            "file": args.weights.name,
            **keys,
            "sha256": sha256_file(args.weights, label=f"hashing {args.weights.name}"),
        }
    else:
        assert random_sizes is not None, "This is a bug: a random model needs V and D."
        module = _random_module(args, kind, *random_sizes, scale)
        source = {"kind": "random", "seed": args.seed, "init": "normal(0,1)"}
    manifest = export_kind_model(
        module,
        ExportOptions(
            out_dir=args.out,
            name=name,
            version=args.model_version,
            weight_dtype=args.dtype,
            force=args.force,
            seed=args.seed,
            source=source,
        ),
    )
    sizes = (
        f"T={manifest.type_vocab_size}"
        if manifest.type_vocab_size is not None
        else f"D'={manifest.factor_dim}"
    )
    print(
        f"exported {manifest.name} v{manifest.version} ({manifest.kind}): "
        f"V={manifest.vocab_size} D={manifest.d_model} {sizes} scale={manifest.scale:g} "
        f"weights={manifest.weight_dtype} max_abs_error={manifest.parity.max_abs_error:g} "
        f"(bound {manifest.parity.tolerance:g}) -> {args.out}"
    )
    return 0


def _random_module(
    args: argparse.Namespace, kind: str, vocab_size: int, d_model: int, scale: float | str
) -> KindModule:
    import torch

    from tokembed.export.kind_modules import FactorizedEmbedding, SegmentEmbedding
    from tokembed.export.module import random_table

    generator = torch.Generator().manual_seed(args.seed + 1)
    if kind == SEGMENT:
        types = args.type_vocab_size or DEFAULT_TYPE_VOCAB_SIZE
        words = random_table(vocab_size, d_model, args.seed, args.padding_idx)
        segment = torch.randn(types, d_model, generator=generator)
        return SegmentEmbedding(words, segment, scale, args.padding_idx)
    inner = args.factor_dim or DEFAULT_FACTOR_DIM
    words = random_table(vocab_size, inner, args.seed, args.padding_idx)
    # A Linear's own initialisation: uniform in +-1/sqrt(D'), weight and bias.
    bound = inner**-0.5
    projection = (torch.rand(d_model, inner, generator=generator) * 2 - 1) * bound
    bias = (torch.rand(d_model, generator=generator) * 2 - 1) * bound
    return FactorizedEmbedding(words, projection, bias, scale, args.padding_idx)


def load_vector(path: Path, key: str) -> torch.Tensor:
    """The 1-D float tensor at ``key`` (a projection's bias), read as ``load_matrix``
    reads a matrix: safetensors by its one tensor, torch files with ``weights_only``."""
    import torch

    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        if path.suffix.lower() == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                names = set(handle.keys())  # a safe_open handle is not iterable
                tensor = handle.get_tensor(key) if key in names else None
        else:
            loaded = torch.load(
                str(path), map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path)
            )
            tensor = _find(loaded, key)
    except Exception as exc:
        raise CheckpointError(f"cannot read {key!r} from {path.name}: {exc}") from exc
    if tensor is None:
        raise CheckpointError(f"key {key!r} not found in {path.name}")
    if tensor.dim() != 1 or not tensor.is_floating_point():
        raise CheckpointError(
            f"{key!r} in {path.name} is {tensor.dtype}{list(tensor.shape)}, expected a 1-D "
            "float vector"
        )
    vector: torch.Tensor = tensor.detach().to(torch.float32).clone()
    return vector


def _find(loaded: object, key: str) -> torch.Tensor | None:
    """``key`` in a state_dict, possibly nested (``{"model": {...}}``) by dotted keys."""
    import torch

    if not isinstance(loaded, dict):
        return None
    value = loaded.get(key)
    if isinstance(value, torch.Tensor):
        return value
    for name, value in loaded.items():
        if isinstance(value, dict) and key.startswith(f"{name}."):
            found = _find(value, key[len(name) + 1 :])
            if found is not None:
                return found
    return None
