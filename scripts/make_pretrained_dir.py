"""Write a synthetic Hugging Face model directory, Llama-shaped, in little memory: a
``config.json`` (``model_type`` llama, untied) and a sharded safetensors checkpoint: the
input embedding ``model.embed_tokens.weight``, the output projection ``lm_head.weight`` and
the final norm ``model.norm.weight``, a shard each, with the index that names them; random
values (``scripts/make_checkpoint.py`` writes each matrix's shard).

    python scripts/make_pretrained_dir.py DIR --vocab-size 128256 --hidden-size 4096 \\
        [--dtype bfloat16]

What the memory measurement of ``tokembed export --from-pretrained`` at Llama-3 scale
reads (docs/export.md, "Time and memory"): the layers are left out, as the exporter never
reads them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from make_checkpoint import write_checkpoint
from safetensors.torch import save_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--hidden-size", type=int, required=True)
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="bfloat16")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    v, d, dtype = args.vocab_size, args.hidden_size, args.dtype
    shards = {
        "model-00001-of-00003.safetensors": ("model.embed_tokens.weight", 0),
        "model-00002-of-00003.safetensors": ("lm_head.weight", 1),
    }
    total = 0
    for name, (key, seed) in shards.items():
        total += write_checkpoint(args.out / name, v, d, dtype, key, seed, 0.02)
    norm = "model-00003-of-00003.safetensors"
    save_file({"model.norm.weight": torch.ones(d, dtype=getattr(torch, dtype))}, args.out / norm)
    total += (args.out / norm).stat().st_size
    weight_map = {key: name for name, (key, _) in shards.items()}
    weight_map["model.norm.weight"] = norm
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (args.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": v,
        "hidden_size": d, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "torch_dtype": dtype, "pad_token_id": None,
    }  # fmt: skip
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    print(f"wrote {args.out}: {total:,} bytes of shards", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
