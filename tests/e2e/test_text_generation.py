"""Generation from tokembed's vectors: tiny random Llama and GPT-2 models built by
transformers from a config (nothing downloaded), saved, exported with the model's own
tokenizer (``tokembed export --weights ... --key ... --tokenizer``) and served; for 10
prompts, transformers' greedy ``generate(inputs_embeds=<embed_text's vectors>)`` gives
the very tokens ``generate(input_ids=<transformers' own tokenization>)`` gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from tokembed.cli.main import main
from tokembed.client import EmbeddingClient

from support.text_models import BPE_SPECIAL, texts

V, D, NEW_TOKENS = 640, 32, 8


def _llama() -> Any:
    config = LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config), "model.embed_tokens.weight"


def _gpt2() -> Any:
    config = GPT2Config(vocab_size=V, n_embd=D, n_layer=2, n_head=4, n_positions=256)
    return GPT2LMHeadModel(config), "transformer.wte.weight"


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_generate_from_served_vectors_equals_generate_from_ids(
    build: Any, tmp_path: Path, trained_tokenizers: dict[str, Path], start_server: Any
) -> None:
    torch.manual_seed(3)
    model, key = build()
    model = model.eval()
    model.generation_config.pad_token_id = 0
    model.save_pretrained(tmp_path / "checkpoint")
    tokenizer_file = trained_tokenizers["bpe"]
    out = tmp_path / "model"
    assert main([
        "export", "--weights", str(tmp_path / "checkpoint"), "--key", key, "--out", str(out),
        "--tokenizer", str(tokenizer_file), "--name", "lm",
    ]) == 0  # fmt: skip
    prompts = [text[:80] for text in texts(40, 21, BPE_SPECIAL) if text.strip()][:10]
    assert len(prompts) == 10
    theirs = AutoTokenizer.from_pretrained(tokenizer_file.parent)
    server = start_server(out)
    with EmbeddingClient(server.target) as client:
        served = client.embed_text(prompts)
    served_ids = np.split(served.input_ids, np.cumsum(served.lengths)[:-1])
    continuations = set()
    for prompt, ids, vectors in zip(prompts, served_ids, served.sequences(), strict=True):
        own = theirs(prompt)["input_ids"]
        assert ids.tolist() == own, prompt
        with torch.no_grad():
            from_ids = model.generate(
                input_ids=torch.tensor([own]), attention_mask=torch.ones(1, len(own), dtype=int),
                max_new_tokens=NEW_TOKENS, do_sample=False,
            )  # fmt: skip
            from_vectors = model.generate(
                inputs_embeds=torch.from_numpy(np.array(vectors))[None],
                attention_mask=torch.ones(1, len(own), dtype=int),
                max_new_tokens=NEW_TOKENS, do_sample=False,
            )  # fmt: skip
        new = from_ids[0, len(own) :].tolist()
        assert len(new) == NEW_TOKENS
        assert from_vectors[0].tolist() == new, prompt
        continuations.add(tuple(new))
    assert len(continuations) > 1  # the prompts matter: not one answer whatever they are
