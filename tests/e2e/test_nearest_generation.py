"""Generation through tokembed, both ways: a tiny GPT-2 (tied) and a tiny Llama with
``tie_word_embeddings=True``, built from configs by transformers (random weights,
nothing downloaded), saved, exported by key with their output projection
(``--output-key lm_head.weight``, which transformers saves once, tied) and served.

Each step embeds the ids so far through tokembed, runs the transformer body in
transformers on those ``inputs_embeds``, and asks tokembed's ``nearest`` (top-1 by
``dot``) for the next id from the body's last hidden state (after its final norm, which
the body applies). 20 prompts x 16 new tokens equal transformers' own greedy
``generate()``, token for token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from tokembed.cli.main import main
from tokembed.client import EmbeddingClient
from tokembed.export.manifest import Manifest

V, D = 256, 32
PROMPTS, PROMPT_LEN, NEW = 20, 6, 16


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=V, n_embd=D, n_layer=2, n_head=2, n_positions=64,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config).eval()


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


CASES = {
    "gpt2": (_gpt2, "transformer.wte.weight", lambda m: m.transformer),
    "llama": (_llama, "model.embed_tokens.weight", lambda m: m.model),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_generation_through_nearest(case, tmp_path: Path, start_server):
    build, key, body_of = CASES[case]
    model = build()
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    model.save_pretrained(tmp_path / "checkpoint")
    out = tmp_path / "model"
    argv = ["export", "--out", str(out), "--weights", str(tmp_path / "checkpoint"),
            "--key", key, "--output-key", "lm_head.weight", "--name", case]  # fmt: skip
    assert main(argv) == 0
    manifest = Manifest.read(out)
    assert manifest.tie is not None and manifest.tie.tied
    assert manifest.head is not None and manifest.head.table == "embedding"
    assert "head.onnx.data" not in manifest.files  # the tied head reads the table itself

    prompts = torch.from_numpy(np.random.default_rng(1).integers(1, V, size=(PROMPTS, PROMPT_LEN)))
    with torch.no_grad():
        want = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
            max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0,
        )[:, PROMPT_LEN:]  # fmt: skip

    body = body_of(model)
    ids = prompts.numpy()
    server = start_server(out)
    with EmbeddingClient(server.target) as client, torch.no_grad():
        for _ in range(NEW):
            embeds = torch.from_numpy(client.embed(ids).copy())
            hidden = body(inputs_embeds=embeds).last_hidden_state[:, -1]
            found = client.nearest(hidden.numpy(), k=1, metric="dot")
            ids = np.concatenate([ids, found.ids], axis=1)
    np.testing.assert_array_equal(ids[:, PROMPT_LEN:], want.numpy())
