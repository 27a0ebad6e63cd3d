"""Write a safetensors checkpoint holding one random ``[V, D]`` matrix, of any size, in
little memory: the header, then the rows, a slice at a time.

    python scripts/make_checkpoint.py OUT.safetensors --vocab-size 128256 --d-model 4096 \\
        --dtype bfloat16 [--key model.embed_tokens.weight] [--seed 0] [--std 0.02]

What the measurements of ``tokembed export`` at checkpoint scale export (docs/export.md,
"Time and memory"; tests/export/test_checkpoint_scale.py): a Llama-3-sized embedding is
V=128256, D=4096, stored in bfloat16 as Meta ships it. The values are N(0, std) from
torch's generator seeded with ``--seed``, drawn a slice at a time, then rounded to the
dtype: the same file for the same arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

_DTYPES = {"float32": (torch.float32, "F32"), "float16": (torch.float16, "F16"),
           "bfloat16": (torch.bfloat16, "BF16")}  # fmt: skip
_SLICE_VALUES = 16 * 1024 * 1024


def write_checkpoint(
    path: Path, vocab_size: int, d_model: int, dtype: str, key: str, seed: int, std: float
) -> int:
    """Write the checkpoint; return its size in bytes."""
    torch_dtype, name = _DTYPES[dtype]
    nbytes = vocab_size * d_model * torch_dtype.itemsize
    header = json.dumps(
        {key: {"dtype": name, "shape": [vocab_size, d_model], "data_offsets": [0, nbytes]}},
        separators=(",", ":"),
    ).encode()
    header += b" " * (-len(header) % 8)  # safetensors aligns the data to 8 bytes
    generator = torch.Generator().manual_seed(seed)
    rows_per_slice = max(1, _SLICE_VALUES // d_model)
    with path.open("wb") as out:
        out.write(len(header).to_bytes(8, "little"))
        out.write(header)
        for start in range(0, vocab_size, rows_per_slice):
            count = min(rows_per_slice, vocab_size - start)
            rows = (torch.randn(count, d_model, generator=generator) * std).to(torch_dtype)
            out.write(rows.view(torch.uint8).numpy().data)
    return path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--d-model", type=int, required=True)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    parser.add_argument("--key", default="model.embed_tokens.weight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--std", type=float, default=0.02)
    args = parser.parse_args(argv)
    size = write_checkpoint(
        args.out, args.vocab_size, args.d_model, args.dtype, args.key, args.seed, args.std
    )
    print(f"wrote {args.out}: {size:,} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
