"""Checked against the real thing: tiny Llama, T5 and BART models built by Hugging Face
transformers from a config (random weights, nothing downloaded), saved as sharded
checkpoints, exported by key, served by the real server and asked through the real client;
the served vectors are compared with what the library's own embedding modules compute on
the same ids.

Each checkpoint comes in two forms, both sharded so that the embedding has a shard of its
own: safetensors (``save_pretrained``; transformers stores a tied matrix once) and ``.bin``
(``pytorch_model-0000N-of-0000M.bin`` beside ``pytorch_model.bin.index.json``, tied keys
sharing one storage). transformers 5 writes only safetensors, so the ``.bin`` form is
written by huggingface_hub's ``save_torch_state_dict``, the writer transformers 4 used,
and proved to be transformers' layout by loading it back with ``from_pretrained``.

Which part of each library's embedding block is compared, and why exactly: tokembed serves
``E[id] * scale``; the library's positions (T5's relative bias, BART's learned positions,
Llama's rotary embedding), its LayerNorm (BART's ``layernorm_embedding``) and its dropout
come after that and are not tokembed's (each test names its module).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from huggingface_hub import save_torch_state_dict
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    T5Config,
    T5ForConditionalGeneration,
)

from tokembed.cli.main import main
from tokembed.client import EmbeddingClient
from tokembed.export.manifest import Manifest, Tie

V, D = 1000, 48  # sqrt(48) is irrational: BART's scale really rounds
FORMATS = ["safetensors", "bin"]
INDEX = {"safetensors": "model.safetensors.index.json", "bin": "pytorch_model.bin.index.json"}
# Smaller than the [V, D] embedding (96 kB in bfloat16, 192 kB in float32): it has a shard
# of its own, and the checkpoint has several.
SHARD = "50KB"


def _save(model: PreTrainedModel, directory: Path, form: str) -> Path:
    """Save ``model`` sharded in ``form``; return its index."""
    if form == "safetensors":
        model.save_pretrained(directory, max_shard_size=SHARD)
    else:
        directory.mkdir()
        save_torch_state_dict(
            model.state_dict(), directory, safe_serialization=False, max_shard_size=SHARD
        )
        model.config.save_pretrained(directory)
        reloaded = type(model).from_pretrained(directory, use_safetensors=False)
        for name, value in model.state_dict().items():
            assert torch.equal(reloaded.state_dict()[name], value), name
    index = directory / INDEX[form]
    assert len(set(json.loads(index.read_text())["weight_map"].values())) > 1
    return index


def _export(index: Path, key: str, out: Path, name: str, *flags: str) -> Manifest:
    argv = ["export", "--out", str(out), "--weights", str(index), "--key", key, "--name", name]
    assert main([*argv, *flags]) == 0
    return Manifest.read(out)


def _library(module: torch.nn.Module, ids: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = module(torch.from_numpy(ids))
    return out


def _ids() -> np.ndarray:
    """Every id, shuffled, as [2, V/2]; then the same ids as a client sends them."""
    return np.random.default_rng(0).permutation(V).astype(np.int64).reshape(2, -1)


# --- Llama: embed_tokens, no scale, untied lm_head, bfloat16 -------------------------------


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    return model


@pytest.mark.parametrize("form", FORMATS)
def test_llama(llama, form, tmp_path, start_server):
    """As float32 and float16 tables (the bfloat16 one, as it ships: below).

    LlamaModel.forward starts ``inputs_embeds = self.embed_tokens(input_ids)``, an
    ``nn.Embedding`` in bfloat16 with no scale; the rotary position embedding is applied
    inside attention, later. Compared: ``model.model.embed_tokens``.

    Exported as float32 (the bfloat16 rows widened exactly) the float32 answers are the
    library's rows widened, bit for bit, and float16 answers its rows rounded to float16.
    Exported as float16 the float32 answers are the rows rounded to float16 and widened,
    bit for bit, within the manifest's tolerance of the library's own. lm_head is untied:
    the manifest says so."""
    index = _save(llama, tmp_path / "llama", form)
    key, flags = "model.embed_tokens.weight", ["--scale", "none"]
    flags += ["--output-projection", "lm_head.weight"]
    wide = _export(index, key, tmp_path / "f32", "llama", *flags)
    half = _export(index, key, tmp_path / "f16", "llama-f16", *flags, "--dtype", "float16")
    assert wide.tie == Tie("lm_head.weight", False, "different values", [key])
    assert (wide.scale, wide.vocab_size, wide.d_model) == (1.0, V, D)
    assert (wide.weight_dtype, half.weight_dtype) == ("float32", "float16")

    ids = _ids()
    rows = _library(llama.model.embed_tokens, ids)
    assert rows.dtype == torch.bfloat16
    server = start_server((tmp_path / "f32", tmp_path / "f16"))
    with EmbeddingClient(server.target) as client:
        np.testing.assert_array_equal(client.embed(ids, model="llama"), rows.float().numpy())
        np.testing.assert_array_equal(
            client.embed(ids, "float16", model="llama"), rows.to(torch.float16).numpy()
        )
        from_half = client.embed(ids, model="llama-f16")
        np.testing.assert_array_equal(from_half, rows.to(torch.float16).float().numpy())
        error = np.abs(from_half.astype(np.float64) - rows.double().numpy()).max()
        assert 0 < error <= half.parity.tolerance


@pytest.mark.parametrize("form", FORMATS)
def test_llama_in_bfloat16(llama, form, tmp_path, start_server):
    """The Llama exported as it ships, bfloat16 (V x D x 2 bytes, the checkpoint's bits):
    compared with ``model.model.embed_tokens`` run in bfloat16, its bfloat16 answers are
    the library's rows bit for bit, its float32 answers those rows widened and its float16
    answers those rows rounded to float16."""
    index = _save(llama, tmp_path / "llama", form)
    key = "model.embed_tokens.weight"
    flags = ["--scale", "none", "--dtype", "bfloat16", "--output-projection", "lm_head.weight"]
    manifest = _export(index, key, tmp_path / "bf16", "llama", *flags)
    assert manifest.weight_dtype == "bfloat16"
    assert manifest.parity.max_abs_error == 0.0  # bfloat16 kept exactly
    assert manifest.tie == Tie("lm_head.weight", False, "different values", [key])
    assert (tmp_path / "bf16" / "model.onnx.data").stat().st_size == V * D * 2
    ids = _ids()
    rows = _library(llama.model.embed_tokens, ids)
    assert rows.dtype == torch.bfloat16
    server = start_server(tmp_path / "bf16")
    with EmbeddingClient(server.target) as client:
        got = client.embed(ids, "bfloat16")
        assert str(got.dtype) == "bfloat16"
        np.testing.assert_array_equal(got.view(np.uint16), rows.view(torch.int16).numpy().view(
            np.uint16))  # fmt: skip
        np.testing.assert_array_equal(client.embed(ids), rows.float().numpy())
        np.testing.assert_array_equal(client.embed(ids, "float16"), rows.to(torch.float16).numpy())


# --- T5: one shared table, no scale, tied to lm_head ---------------------------------------


@pytest.fixture(scope="module")
def t5() -> T5ForConditionalGeneration:
    torch.manual_seed(2)
    config = T5Config(vocab_size=V, d_model=D, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
    assert config.tie_word_embeddings
    model = T5ForConditionalGeneration(config).eval()
    for entrance in (model.encoder.embed_tokens, model.decoder.embed_tokens, model.lm_head):
        assert entrance.weight.data_ptr() == model.shared.weight.data_ptr()
    return model


@pytest.mark.parametrize("form", FORMATS)
def test_t5(t5, form, tmp_path, start_server, caplog):
    """T5Stack.forward starts ``inputs_embeds = self.embed_tokens(input_ids)``, an
    ``nn.Embedding`` tied to ``shared``, with no scale; dropout follows, and the relative
    position bias lives in attention. Compared: ``model.encoder.embed_tokens`` and
    ``model.decoder.embed_tokens``, bit for bit, each served under its own name from
    ``shared.weight`` exported twice: the server holds the one table once.

    The tie: safetensors stores ``shared.weight`` alone and config.json declares
    ``tie_word_embeddings``; the ``.bin`` stores one storage under all four keys."""
    index = _save(t5, tmp_path / "t5", form)
    flags = ["--scale", "none", "--output-projection", "lm_head.weight"]
    encoder = _export(index, "shared.weight", tmp_path / "encoder", "t5-encoder", *flags)
    decoder = _export(index, "shared.weight", tmp_path / "decoder", "t5-decoder", *flags)
    assert encoder.files == decoder.files  # the same bytes: one table
    tie = encoder.tie
    assert tie is not None and tie.tied and tie.output_projection == "lm_head.weight"
    if form == "safetensors":
        assert tie.keys == ["shared.weight"]
        assert tie.evidence.startswith("config.json: tie_word_embeddings")
    else:
        assert tie.evidence == "shared storage"
        assert tie.keys == ["shared.weight", "decoder.embed_tokens.weight",
                            "encoder.embed_tokens.weight", "lm_head.weight"]  # fmt: skip

    with caplog.at_level(logging.INFO, logger="tokembed.server.models.loading"):
        server = start_server((tmp_path / "encoder", tmp_path / "decoder"))
    assert any("row tables are shared" in r.getMessage() for r in caplog.records)
    ids = _ids()
    with EmbeddingClient(server.target) as client:
        for name, module in (("t5-encoder", t5.encoder.embed_tokens),
                             ("t5-decoder", t5.decoder.embed_tokens)):  # fmt: skip
            want = _library(module, ids).numpy()
            assert want.dtype == np.float32
            np.testing.assert_array_equal(client.embed(ids, model=name), want)


# --- BART: encoder and decoder embed with sqrt(d_model), padding id 1 ---------------------


@pytest.fixture(scope="module")
def bart() -> BartForConditionalGeneration:
    torch.manual_seed(3)
    config = BartConfig(
        vocab_size=V, d_model=D, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, scale_embedding=True,
    )  # fmt: skip
    model = BartForConditionalGeneration(config).eval()
    assert model.config.pad_token_id == 1
    for entrance in (model.model.encoder.embed_tokens, model.model.decoder.embed_tokens):
        assert entrance.weight.data_ptr() == model.model.shared.weight.data_ptr()
        assert entrance.embed_scale == math.sqrt(D)
    return model


@pytest.mark.parametrize("form", FORMATS)
def test_bart(bart, form, tmp_path, start_server):
    """BartEncoder.forward (and BartDecoder's) starts ``inputs_embeds =
    self.embed_tokens(input_ids)``, a ``BartScaledWordEmbedding``: the float32 row times
    ``embed_scale`` (``math.sqrt(d_model)`` when ``config.scale_embedding``, a Python
    float, so torch multiplies in float32), exactly tokembed's float32 graph. The learned
    positions (``embed_positions``) are added after it and ``layernorm_embedding``
    applied: not tokembed's. Compared: both ``embed_tokens``, bit for bit, ragged
    requests' padding included (the padding id 1's row, zero, times the scale)."""
    index = _save(bart, tmp_path / "bart", form)
    flags = ["--scale", "sqrt", "--padding-idx", "1", "--output-projection", "lm_head.weight"]
    encoder = _export(index, "model.shared.weight", tmp_path / "encoder", "bart-encoder", *flags)
    _export(index, "model.shared.weight", tmp_path / "decoder", "bart-decoder", *flags)
    assert encoder.scale == math.sqrt(D) and encoder.padding_idx == 1
    tie = encoder.tie
    assert tie is not None and tie.tied
    expected_evidence = "shared storage" if form == "bin" else "config.json: tie_word_embeddings"
    assert tie.evidence.startswith(expected_evidence)

    server = start_server((tmp_path / "encoder", tmp_path / "decoder"))
    ids = _ids()
    ragged = [[5, 6, 7], [8], [1, 999, 0, 2, 3]]
    with EmbeddingClient(server.target) as client:
        for name, module in (("bart-encoder", bart.model.encoder.embed_tokens),
                             ("bart-decoder", bart.model.decoder.embed_tokens)):  # fmt: skip
            np.testing.assert_array_equal(
                client.embed(ids, model=name), _library(module, ids).numpy()
            )
            padded = np.array([row + [1] * (5 - len(row)) for row in ragged], dtype=np.int64)
            np.testing.assert_array_equal(
                client.embed(ragged, model=name), _library(module, padded).numpy()
            )
