"""A checkpoint's ``config.json`` decides its scale and padding id: tiny models of every
architecture docs/export.md names, built by transformers from a config (random weights,
nothing downloaded) and saved by ``save_pretrained``, exported the README's way (no
``--scale``), give exactly what the model's own input-embedding module computes on every
id, bit for bit (Gemma's bfloat16-rounded sqrt(D) included); a ``--scale`` or
``--padding-idx`` that contradicts the architecture is refused in one line naming the
flag that overrides; ``pad_token_id`` is recorded."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors import safe_open
from transformers import (
    AlbertConfig,
    AlbertModel,
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BertForMaskedLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

from tokembed.export.manifest import Manifest

V, D = 1000, 48  # sqrt(48) is irrational: a scale really rounds
_DECODER = dict(
    vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=2, head_dim=24,
)  # fmt: skip

# name: (build the model, its dtype); every one with pad_token_id set, so that it is recorded.
ARCHITECTURES: dict[str, tuple[Any, torch.dtype]] = {
    "llama": (lambda: LlamaForCausalLM(LlamaConfig(**_DECODER, pad_token_id=0)), torch.bfloat16),
    "mistral": (lambda: MistralForCausalLM(MistralConfig(**_DECODER, pad_token_id=2)),
                torch.bfloat16),
    "qwen2": (lambda: Qwen2ForCausalLM(Qwen2Config(**_DECODER, pad_token_id=3)), torch.bfloat16),
    "gemma": (lambda: GemmaForCausalLM(GemmaConfig(**_DECODER, pad_token_id=0)), torch.bfloat16),
    "gemma-float32": (lambda: GemmaForCausalLM(GemmaConfig(**_DECODER, pad_token_id=0)),
                      torch.float32),
    "gemma-float16": (lambda: GemmaForCausalLM(GemmaConfig(**_DECODER, pad_token_id=0)),
                      torch.float16),
    "gemma2": (lambda: Gemma2ForCausalLM(Gemma2Config(**_DECODER, pad_token_id=0)),
               torch.bfloat16),
    "gemma3_text": (lambda: Gemma3ForCausalLM(Gemma3TextConfig(**_DECODER, pad_token_id=0)),
                    torch.bfloat16),
    "gpt2": (lambda: GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=D, n_layer=1, n_head=2,
                                                pad_token_id=7)), torch.float32),
    "bert": (lambda: BertForMaskedLM(BertConfig(vocab_size=V, hidden_size=D, num_hidden_layers=1,
                                                num_attention_heads=2, intermediate_size=64)),
             torch.float32),
    "albert": (lambda: AlbertModel(AlbertConfig(vocab_size=V, embedding_size=16, hidden_size=D,
                                                num_hidden_layers=1, num_attention_heads=2,
                                                intermediate_size=64)), torch.float32),
    "t5": (lambda: T5ForConditionalGeneration(T5Config(vocab_size=V, d_model=D, d_kv=8, d_ff=64,
                                                       num_layers=1, num_heads=2)),
           torch.float32),
    "bart": (lambda: BartForConditionalGeneration(BartConfig(
        vocab_size=V, d_model=D, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=64, scale_embedding=True)), torch.float32),
    "bart-unscaled": (lambda: BartForConditionalGeneration(BartConfig(
        vocab_size=V, d_model=D, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=64, scale_embedding=False)), torch.float32),
}  # fmt: skip

# What each computes, written out from transformers' modeling code (not asked of it).
SQRT_D = math.sqrt(D)
SCALES = {
    "gemma": float(torch.tensor(SQRT_D).to(torch.bfloat16)),  # 6.9375
    "gemma-float32": float(np.float32(SQRT_D)),
    "gemma-float16": float(np.float16(np.float32(SQRT_D))),
    "gemma2": 6.9375,
    "gemma3_text": 6.9375,
    "bart": SQRT_D,
}


def _save(name: str, directory: Path) -> tuple[PreTrainedModel, Path, str]:
    """The model, its saved safetensors file and the key of its input embedding there."""
    build, dtype = ARCHITECTURES[name]
    torch.manual_seed(5)
    model = build().to(dtype).eval()
    model.save_pretrained(directory)
    weights = directory / "model.safetensors"
    embedding = model.get_input_embeddings().weight
    with safe_open(str(weights), framework="pt") as handle:
        saved = set(handle.keys())
    keys = [k for k, t in model.state_dict().items() if t.data_ptr() == embedding.data_ptr()]
    key = next(k for k in keys if k in saved)
    return model, weights, key


def _run(model_dir: Path, ids: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(
        str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    out: np.ndarray = session.run(["hidden_states"], {"input_ids": ids})[0]
    return out


def _ids() -> np.ndarray:
    return np.random.default_rng(0).permutation(V).astype(np.int64).reshape(2, -1)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_exported_the_readme_way_it_computes_what_the_model_computes(name, tmp_path, tokembed_main):
    """No --scale, no --padding-idx: the model's own ``get_input_embeddings()`` on every id,
    bit for bit, in the model's dtype (the graph's float32 rows rounded to it, as the
    server rounds an answer); the scale and padding id in the manifest are the model's."""
    model, weights, key = _save(name, tmp_path / "model")
    out = tmp_path / "repo" / "m" / "3"
    proc = tokembed_main("export", "--out", out, "--weights", weights, "--key", key)
    assert proc.returncode == 0, proc.stderr
    manifest = Manifest.read(out)
    assert manifest.scale == SCALES.get(name, 1.0)
    assert manifest.padding_idx == model.config.pad_token_id
    ids = _ids()
    with torch.no_grad():
        want = model.get_input_embeddings()(torch.from_numpy(ids))
    got = torch.from_numpy(_run(out, ids)).to(want.dtype)
    assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))


def test_gemma_in_bfloat16_rounds_sqrt_d_as_transformers_does(tmp_path, tokembed_main):
    """6.9375, not 6.9282: sqrt(48) rounded to bfloat16 before the multiply; the exported
    bfloat16 table's bfloat16 answers are the model's, and so is what generate() makes of
    them."""
    model, weights, key = _save("gemma", tmp_path / "gemma")
    out = tmp_path / "gemma-bf16"
    flags = ["--dtype", "bfloat16"]
    assert tokembed_main("export", "--out", out, "--weights", weights, "--key", key, *flags
                         ).returncode == 0  # fmt: skip
    assert Manifest.read(out).scale == 6.9375
    ids = np.array([[5, 17, 999, 0, 42]], dtype=np.int64)
    embeds = torch.from_numpy(_run(out, ids)).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(embeds, model.model.embed_tokens(torch.from_numpy(ids)))
        settings: dict[str, Any] = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        from_ids = model.generate(torch.from_numpy(ids), **settings)[:, ids.shape[1] :]
        from_embeds = model.generate(inputs_embeds=embeds, **settings)
    assert torch.equal(from_ids, from_embeds[:, -from_ids.shape[1] :])


def test_readme_llama_line_feeds_generate_what_input_ids_would(tmp_path, tokembed_main):
    """The README's ``tokembed export --out repo/llama/3 --weights model.safetensors --key
    model.embed_tokens.weight``: the vectors fed to ``generate(inputs_embeds=...)`` give
    the tokens ``generate(input_ids=...)`` gives."""
    model, weights, key = _save("llama", tmp_path / "llama")
    out = tmp_path / "repo" / "llama" / "3"
    assert tokembed_main("export", "--out", out, "--weights", weights, "--key", key
                         ).returncode == 0  # fmt: skip
    ids = np.array([[5, 17, 999, 3, 42, 8]], dtype=np.int64)
    embeds = torch.from_numpy(_run(out, ids)).to(torch.bfloat16)
    settings: dict[str, Any] = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        # The next-token scores themselves, bit for bit (a tiny random model may pick the
        # same tokens from vectors scaled by sqrt(D): its norms undo much of a scale).
        logits = model(inputs_embeds=embeds).logits
        assert torch.equal(logits, model(input_ids=torch.from_numpy(ids)).logits)
        from_ids = model.generate(torch.from_numpy(ids), **settings)[:, ids.shape[1] :]
        from_embeds = model.generate(inputs_embeds=embeds, **settings)
    assert torch.equal(from_ids, from_embeds[:, -from_ids.shape[1] :])


@pytest.mark.parametrize(
    ("name", "flags", "fragments"),
    [
        ("llama", ["--scale", "sqrt"], ["--scale sqrt", "llama", "scale 1", "--override-config"]),
        ("llama", ["--scale", "2"], ["--scale 2", "llama", "--override-config"]),
        ("gemma", ["--scale", "none"], ["--scale none", "gemma", "6.9375", "--override-config"]),
        ("bart-unscaled", ["--scale", "sqrt"], ["--scale sqrt", "bart", "scale_embedding"]),
        ("llama", ["--padding-idx", "5"], ["--padding-idx 5", "pad_token_id 0",
                                           "--override-config"]),
    ],
)  # fmt: skip
def test_a_flag_that_contradicts_the_architecture_is_refused(
    name, flags, fragments, tmp_path, tokembed_main, user_error
):
    _, weights, key = _save(name, tmp_path / "model")
    out = tmp_path / "out"
    proc = tokembed_main("export", "--out", out, "--weights", weights, "--key", key, *flags)
    user_error(proc, *fragments)
    assert not out.exists()
    # The flag the line names overrides: the export then does as asked.
    proc = tokembed_main("export", "--out", out, "--weights", weights, "--key", key, *flags,
                         "--override-config")  # fmt: skip
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(("name", "scale"), [("gemma", "sqrt"), ("gemma", "6.9375"),
                                             ("llama", "none"), ("llama", "1")])  # fmt: skip
def test_a_flag_that_agrees_is_accepted(name, scale, tmp_path, tokembed_main):
    """``--scale sqrt`` is what a Gemma run in float32 computes (float32's sqrt(D))."""
    _, weights, key = _save(name, tmp_path / "model")
    proc = tokembed_main("export", "--out", tmp_path / "out", "--weights", weights, "--key", key,
                         "--scale", scale)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_bert_segment_model_takes_its_padding_from_config(tmp_path, tokembed_main, user_error):
    """The segment kind (BERT) reads config.json as the token kind does."""
    model, weights, _ = _save("bert", tmp_path / "bert")
    prefix = "bert.embeddings."
    args = ["export", "--weights", weights, "--key", f"{prefix}word_embeddings.weight",
            "--segment-key", f"{prefix}token_type_embeddings.weight"]  # fmt: skip
    assert tokembed_main(*args, "--out", tmp_path / "ok").returncode == 0
    manifest = Manifest.read(tmp_path / "ok")
    assert (manifest.scale, manifest.padding_idx) == (1.0, model.config.pad_token_id)
    user_error(tokembed_main(*args, "--out", tmp_path / "no", "--scale", "sqrt"),
               "--scale sqrt", "bert", "--override-config")  # fmt: skip


def test_an_unknown_architecture_keeps_the_flags_and_says_so(tmp_path, tokembed_main):
    _, weights, key = _save("llama", tmp_path / "model")
    config_path = tmp_path / "model" / "config.json"
    config = json.loads(config_path.read_text())
    config["model_type"] = "not-a-model"
    config_path.write_text(json.dumps(config))
    proc = tokembed_main("export", "--out", tmp_path / "out", "--weights", weights, "--key", key)
    assert proc.returncode == 0, proc.stderr
    assert Manifest.read(tmp_path / "out").scale == SQRT_D
    assert "'not-a-model'" in proc.stderr and "--scale" in proc.stderr


def test_the_multimodal_gemma3_reads_its_text_config(tmp_path):
    """``gemma3`` (Gemma3ForConditionalGeneration) keeps its language model's sizes and
    padding id in ``text_config``; the table is that model's."""
    from tokembed.export.architecture import Architecture, architecture_of

    config = {"model_type": "gemma3", "pad_token_id": 9,
              "text_config": {"model_type": "gemma3_text", "vocab_size": V, "hidden_size": D,
                              "pad_token_id": 0}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    found = architecture_of(tmp_path / "model.safetensors", (V, D), "bfloat16")
    assert isinstance(found, Architecture)
    assert (found.model_type, found.scale, found.padding_idx) == ("gemma3_text", 6.9375, 0)
    # Another matrix than the word embedding (the sizes differ): nothing to say about it.
    assert architecture_of(tmp_path / "model.safetensors", (V, 16), "bfloat16") is None
