"""The head (``export.head``): what the manifest records, the head graph in onnxruntime,
an untied output table and a final norm against transformers, and the refusals.

The logit lens: a tiny untied Llama exported with ``--output-key lm_head.weight`` and its
final RMSNorm (``--norm-key model.norm.weight``), served; ``nearest(h, apply_norm=True,
logits=True)`` on an intermediate layer's hidden states is transformers'
``lm_head(norm(h))``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from tokembed.cli.main import main
from tokembed.client import EmbeddingClient
from tokembed.export.head import HEAD_DATA_NAME, HEAD_NAME
from tokembed.export.manifest import Manifest
from tokembed.export.model_dir import load_model_dir

V, D = 128, 32


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaForCausalLM, Path]:
    torch.manual_seed(2)
    config = LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # a norm weight that is not all ones, so that it counts
        model.model.norm.weight.copy_(torch.rand(D) + 0.5)
    directory = tmp_path_factory.mktemp("llama") / "checkpoint"
    model.save_pretrained(directory)
    return model, directory


def _export(out: Path, checkpoint: Path, key: str, *flags: str) -> Manifest:
    argv = ["export", "--out", str(out), "--weights", str(checkpoint), "--key", key, *flags]
    assert main(argv) == 0
    return Manifest.read(out)


def test_untied_head_with_its_norm_is_the_logit_lens(llama, tmp_path, start_server):
    model, checkpoint = llama
    manifest = _export(
        tmp_path / "m", checkpoint, "model.embed_tokens.weight", "--output-key",
        "lm_head.weight", "--norm-key", "model.norm.weight", "--norm-kind", "rmsnorm",
        "--norm-eps", "1e-5", "--name", "lens",
    )  # fmt: skip
    head = manifest.head
    assert head is not None and head.table == "output" and head.output_key == "lm_head.weight"
    assert head.norm is not None and (head.norm.kind, head.norm.eps) == ("rmsnorm", 1e-5)
    assert {HEAD_NAME, HEAD_DATA_NAME} <= set(manifest.files)
    assert 0 <= head.parity.max_abs_error <= head.parity.tolerance
    load_model_dir(tmp_path / "m")  # the files' hashes hold

    ids = torch.from_numpy(np.random.default_rng(0).integers(0, V, size=(3, 7)))
    with torch.no_grad():
        states = model.model(ids, output_hidden_states=True).hidden_states
        middle = states[1]  # after the first layer: no final norm applied yet
        want = model.lm_head(model.model.norm(middle)).numpy()
    server = start_server(tmp_path / "m")
    with EmbeddingClient(server.target) as client:
        found = client.nearest(middle.numpy(), k=3, logits=True, apply_norm=True)
        info = client.info()
    assert found.logits is not None
    np.testing.assert_allclose(found.logits, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(found.ids, np.argsort(-want, axis=-1, kind="stable")[..., :3])
    assert info.head is not None and (info.head.table, info.head.norm) == ("output", "rmsnorm")


def test_the_head_graph_computes_the_layernorm_and_topk(tmp_path):
    """GPT-2's ln_f (a LayerNorm with bias) and its tied head, in onnxruntime."""
    torch.manual_seed(3)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=D, n_layer=1, n_head=2)).eval()
    with torch.no_grad():
        model.transformer.ln_f.weight.copy_(torch.rand(D) + 0.5)
        model.transformer.ln_f.bias.copy_(torch.rand(D))
    model.save_pretrained(tmp_path / "checkpoint")
    manifest = _export(
        tmp_path / "m", tmp_path / "checkpoint", "transformer.wte.weight", "--output-key",
        "lm_head.weight", "--norm-key", "transformer.ln_f.weight", "--norm-bias-key",
        "transformer.ln_f.bias", "--norm-kind", "layernorm", "--norm-eps", "1e-5",
    )  # fmt: skip
    assert manifest.head is not None and manifest.head.table == "embedding"
    assert HEAD_DATA_NAME not in manifest.files
    h = torch.randn(5, D)
    with torch.no_grad():
        want = model.lm_head(model.transformer.ln_f(h))
    session = ort.InferenceSession(str(tmp_path / "m" / HEAD_NAME))
    scores, ids, logits = session.run(
        ["scores", "ids", "logits"], {"vectors": h.numpy(), "k": np.array([4], np.int64)}
    )
    np.testing.assert_allclose(logits, want.numpy(), rtol=1e-4, atol=1e-5)
    values, top = torch.topk(want, 4)
    np.testing.assert_array_equal(ids, top.numpy())
    np.testing.assert_allclose(scores, values.numpy(), rtol=1e-4, atol=1e-5)


def test_a_random_table_with_a_tied_head(tmp_path, capsys):
    out = tmp_path / "m"
    argv = ["export", "--out", str(out), "--vocab-size", "64", "--d-model", "8", "--tied-head"]
    assert main(argv) == 0
    raw = json.loads((out / "manifest.json").read_text())
    assert raw["head"]["table"] == "embedding" and "head.onnx" in raw["files"]
    assert "head: head.onnx over the embedding table" in capsys.readouterr().out


def test_a_model_without_a_head_records_none(tmp_path):
    out = tmp_path / "m"
    assert main(["export", "--out", str(out), "--vocab-size", "64", "--d-model", "8"]) == 0
    manifest = Manifest.read(out)
    assert manifest.head is None and HEAD_NAME not in manifest.files
    assert "head" not in json.loads((out / "manifest.json").read_text())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--output-key", "lm_head.weight"], "--output-key needs --weights"),
        (["--norm-key", "n"], "--norm-key needs --weights"),
        (["--norm-eps", "1e-5"], "--norm-eps need(s) --norm-key"),
        (["--tied-head", "--output-key", "k"], "--output-key needs --weights"),
    ],
)
def test_flags_that_cannot_be_right_are_one_line(tmp_path, capsys, flags, message):
    argv = ["export", "--out", str(tmp_path / "m"), "--vocab-size", "64", "--d-model", "8"]
    assert main([*argv, *flags]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_norm_flags_from_a_checkpoint(llama, tmp_path, capsys):
    _, checkpoint = llama
    base = ["export", "--out", str(tmp_path / "m"), "--weights", str(checkpoint),
            "--key", "model.embed_tokens.weight", "--output-key", "lm_head.weight"]  # fmt: skip
    assert main([*base, "--norm-key", "model.norm.weight"]) != 0
    assert "--norm-key needs --norm-kind and --norm-eps" in capsys.readouterr().err
    wrong = ["--norm-key", "model.norm.weight", "--norm-kind", "rmsnorm", "--norm-eps", "0"]
    assert main([*base, *wrong]) != 0
    assert "--norm-eps must be positive, got 0.0" in capsys.readouterr().err
    missing = ["--norm-key", "model.nope", "--norm-kind", "rmsnorm", "--norm-eps", "1e-5"]
    assert main([*base, *missing]) != 0
    assert "key 'model.nope' not found" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()  # no model left behind without the head it asked for
