"""``tokembed nearest``: vectors back to ids with a running server (the Nearest RPC).

The vectors come from a ``.npy`` file (``[N, D]`` or ``[B, S, D]``; float32, float16, or
bfloat16 saved as its uint16 bits with ``--bfloat16-bits``); the ids and scores are
printed, or saved with ``--output`` (an ``.npz`` of ``ids``, ``scores`` and ``logits``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    common: argparse.ArgumentParser,
) -> None:
    nearest = subparsers.add_parser(
        "nearest",
        parents=[common],
        help="the ids whose rows of the model's output table score highest for vectors",
        description="Call Nearest: for each vector of --vectors, the k ids of the model's "
        "output table (its tied embedding table, or its exported output projection) with "
        "the largest scores, by dot product (the head's logits) or cosine.",
    )
    nearest.add_argument(
        "--vectors",
        required=True,
        type=Path,
        metavar="FILE",
        help="a .npy file of [N, D] or [B, S, D] vectors",
    )
    nearest.add_argument("--k", type=int, default=5, help="ids per vector (default 5)")
    nearest.add_argument(
        "--metric",
        choices=["dot", "cosine"],
        default="dot",
        help="dot (the logits, default) or cosine",
    )
    nearest.add_argument(
        "--apply-norm",
        action="store_true",
        help="apply the model's final norm first (the logit lens)",
    )
    nearest.add_argument(
        "--logits",
        action="store_true",
        help="also ask for the [..., V] logits (saved with --output)",
    )
    nearest.add_argument(
        "--bfloat16-bits",
        action="store_true",
        help="--vectors holds uint16: bfloat16's bits (as `embed` saves them)",
    )
    nearest.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="the served model (default: the server's default model)",
    )
    nearest.add_argument(
        "--output",
        type=Path,
        default=None,
        metavar="FILE",
        help="save ids, scores (and logits) to FILE, numpy's .npz format",
    )
    nearest.add_argument("--timeout-s", type=float, default=30.0, help="per call (default 30)")
    nearest.set_defaults(run=run_nearest)


def run_nearest(args: argparse.Namespace) -> int:
    import numpy as np

    from tokembed.cli.client import _client
    from tokembed.client.errors import EmbeddingError

    try:
        vectors = np.load(args.vectors, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise EmbeddingError(f"cannot read --vectors {args.vectors}: {exc}") from exc
    if args.bfloat16_bits:
        from tokembed.client.dtypes import BFLOAT16

        if vectors.dtype != np.uint16:
            raise EmbeddingError(f"--bfloat16-bits needs uint16 vectors, got {vectors.dtype}")
        vectors = vectors.view(BFLOAT16.numpy)
    with _client(args) as client:
        found = client.nearest(
            vectors,
            k=args.k,
            metric=args.metric,
            logits=args.logits,
            apply_norm=args.apply_norm,
            model=args.model,
        )
    if args.output is not None:
        arrays: dict[str, Any] = {"ids": found.ids, "scores": found.scores}
        if found.logits is not None:
            arrays["logits"] = found.logits
        try:
            with args.output.open("wb") as file:
                np.savez(file, **arrays)
        except OSError as exc:
            raise EmbeddingError(f"cannot write --output {args.output}: {exc.strerror}") from exc
        print(f"saved {', '.join(arrays)} to {args.output}")
    print(f"ids {list(found.ids.shape)}, model {found.model_name} {found.model_version}")
    flat_ids = found.ids.reshape(-1, found.ids.shape[-1])
    flat_scores = found.scores.reshape(flat_ids.shape)
    for row, (ids, scores) in enumerate(zip(flat_ids[:8], flat_scores[:8], strict=True)):
        pairs = ", ".join(f"{int(i)} ({float(s):.4g})" for i, s in zip(ids, scores, strict=True))
        print(f"  vector {row}: {pairs}")
    if len(flat_ids) > 8:
        print(f"  ... {len(flat_ids) - 8} more")
    t = found.timings
    print(
        f"server: queue {t.queue_seconds * 1e3:.3f} ms, compute {t.compute_seconds * 1e3:.3f} "
        f"ms; batch of {t.batch_requests} request(s), {t.batch_tokens} vector(s)"
    )
    return 0
