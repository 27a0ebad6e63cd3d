"""``tokembed export --from-pretrained DIR``, end to end: tiny random models of each
architecture, made from configs with transformers (nothing downloaded), saved with
``save_pretrained`` (one file, and sharded), exported, served by the real server and read
back through the real client.

- The served vectors are the model's own ``get_input_embeddings()(ids)`` bit for bit:
  what its ``inputs_embeds`` takes (Gemma's scaled embedding module included, BART's with
  ``scale_embedding``; BERT's and ALBERT's word embeddings alone, before the segment and
  position embeddings the model adds itself).
- GetModelInfo (and V2's model config) report the architecture, the convention and what
  each engine expects.
- Greedy ``generate(inputs_embeds=<served vectors>)`` equals ``generate(input_ids=...)``
  token for token, 10 prompts each, for Llama, GPT-2, Gemma, Gemma 2 and Gemma 3.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from tokembed.cli.main import main as cli_main
from tokembed.client import EmbeddingClient
from tokembed.export.pretrained_table import ENGINE_VERSIONS
from tokembed.server.process.settings import Settings

from support.server import ServerThread

V, D = 256, 48  # sqrt(48) is irrational: Gemma's and BART's scale really rounds
LAYERS = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
DECODER = dict(vocab_size=V, hidden_size=D, num_key_value_heads=2, **LAYERS)


def _models() -> dict[str, Callable[[], Any]]:
    t = transformers
    gemma = dict(DECODER, head_dim=12)
    return {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**DECODER)),
        "mistral": lambda: t.MistralForCausalLM(t.MistralConfig(**DECODER)),
        "qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**DECODER)),
        "gemma": lambda: t.GemmaForCausalLM(t.GemmaConfig(**gemma)),
        "gemma2": lambda: t.Gemma2ForCausalLM(t.Gemma2Config(**gemma)),
        "gemma3_text": lambda: t.Gemma3ForCausalLM(t.Gemma3TextConfig(**gemma)),
        "gpt2": lambda: t.GPT2LMHeadModel(
            t.GPT2Config(
                vocab_size=V, n_embd=D, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
            )
        ),
        "bert": lambda: t.BertForMaskedLM(t.BertConfig(vocab_size=V, hidden_size=D, **LAYERS)),
        "albert": lambda: t.AlbertForMaskedLM(
            t.AlbertConfig(vocab_size=V, hidden_size=D, embedding_size=16, **LAYERS)
        ),
        "t5": lambda: t.T5ForConditionalGeneration(
            t.T5Config(vocab_size=V, d_model=D, d_ff=64, d_kv=12, num_layers=2, num_heads=4)
        ),
        "bart": lambda: t.BartForConditionalGeneration(
            t.BartConfig(
                vocab_size=V,
                d_model=D,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                scale_embedding=True,
            )
        ),
    }


MODELS = _models()
# Saved sharded too (small shards: the table alone in one), to read through an index.
SHARDED = ("llama", "gemma2")
# Saved as a torch state_dict too (pytorch_model.bin, as transformers 4.x saved by default;
# 5.x writes safetensors only): GPT-2's tied keys are then one stored tensor.
TORCH_FILE = ("gpt2",)
GENERATING = ("llama", "gpt2", "gemma", "gemma2", "gemma3_text")
# Saved tied too (Llama's config unties by default): its head is then the table itself.
TIED = ("llama",)


class _Exported:
    """Per name ("llama", "llama-sharded", "gpt2-bin"): the model, its saved directory, the exported
    model directory and what the export printed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.models: dict[str, Any] = {}
        self.dirs: dict[str, Path] = {}
        self.printed: dict[str, str] = {}

    def make(self, capsys: Any) -> None:
        for index, (arch, build) in enumerate(MODELS.items()):
            torch.manual_seed(index)
            model = build().eval()
            with torch.no_grad():  # rows of a visible size (the init's are 0.02-wide)
                model.get_input_embeddings().weight.normal_()
            self.models[arch] = model
            saved = self.root / "saved" / arch
            model.save_pretrained(saved)
            self._export(arch, saved, capsys)
            if arch in SHARDED:
                sharded = self.root / "saved" / f"{arch}-sharded"
                model.save_pretrained(sharded, max_shard_size="20KB")
                assert (sharded / "model.safetensors.index.json").is_file()
                assert len(list(sharded.glob("model-*.safetensors"))) > 1
                self._export(f"{arch}-sharded", sharded, capsys)
            if arch in TORCH_FILE:
                as_bin = self.root / "saved" / f"{arch}-bin"
                as_bin.mkdir(parents=True)
                (as_bin / "config.json").write_bytes((saved / "config.json").read_bytes())
                torch.save(model.state_dict(), as_bin / "pytorch_model.bin")
                self._export(f"{arch}-bin", as_bin, capsys)
            if arch in TIED:
                config = model.config.to_dict() | {"tie_word_embeddings": True}
                tied = type(model)(type(model.config).from_dict(config)).eval()
                with torch.no_grad():
                    tied.get_input_embeddings().weight.normal_()
                self.models[f"{arch}-tied"] = tied
                tied.save_pretrained(self.root / "saved" / f"{arch}-tied")
                self._export(f"{arch}-tied", self.root / "saved" / f"{arch}-tied", capsys)

    def _export(self, name: str, saved: Path, capsys: Any) -> None:
        out = self.root / "models" / name
        capsys.readouterr()
        code = cli_main(["export", "--from-pretrained", str(saved), "--out", str(out)])
        printed = capsys.readouterr()
        assert code == 0, printed.err
        self.dirs[name] = out
        self.printed[name] = printed.out


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> _Exported:
    # capsys is function-scoped: the module's exports read their output through a
    # capture of their own.
    done = _Exported(tmp_path_factory.mktemp("pretrained"))
    done.make(_Capture())
    return done


class _Capture:
    """capsys's readouterr() for a module fixture: stdout and stderr of ``cli_main``."""

    def __init__(self) -> None:
        import contextlib
        import io

        self._out, self._err = io.StringIO(), io.StringIO()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(contextlib.redirect_stdout(self._out))
        self._stack.enter_context(contextlib.redirect_stderr(self._err))

    def readouterr(self) -> Any:
        from types import SimpleNamespace

        captured = SimpleNamespace(out=self._out.getvalue(), err=self._err.getvalue())
        self._out.seek(0), self._out.truncate(), self._err.seek(0), self._err.truncate()
        return captured


@pytest.fixture(scope="module")
def client(exported: _Exported) -> Iterator[EmbeddingClient]:
    """One real server serving every exported model (by name), and a client of it."""
    settings = Settings(model_dir=tuple(exported.dirs.values()), port=0, metrics_port=0)
    server = ServerThread(settings.validate()).start()
    try:
        with EmbeddingClient(server.target) as connected:
            yield connected
    finally:
        server.stop()


def _ids(seed: int, padding_id: int | None) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(0, V, size=(3, 9), dtype=np.int64)
    ids[0, :2] = [0, V - 1]
    if padding_id is not None:
        ids[1, -1] = padding_id
    return ids


def _bits(array: np.ndarray) -> np.ndarray:
    assert array.dtype == np.float32, array.dtype
    return array.view(np.uint32)


NAMES = [*MODELS, *(f"{arch}-sharded" for arch in SHARDED), *(f"{a}-bin" for a in TORCH_FILE)]


@pytest.mark.parametrize("name", NAMES)
def test_served_vectors_are_what_inputs_embeds_takes(
    name: str, exported: _Exported, client: EmbeddingClient
) -> None:
    arch = name.removesuffix("-sharded").removesuffix("-bin")
    model = exported.models[arch]
    info = client.info(name)
    ids = _ids(len(name), info.padding_id)
    served = client.embed(ids, model=name)
    with torch.no_grad():
        want = model.get_input_embeddings()(torch.from_numpy(ids)).numpy()
    assert served.shape == want.shape
    assert np.array_equal(_bits(served), _bits(want)), f"{name}: served != inputs_embeds"
    assert info.architecture == arch


# What each architecture's manifest says: the key of its table, the scale its served
# vectors carry (that of transformers' embedding module), the scale vLLM 0.34.0 and SGLang
# 0.5.23 expect (None: not recorded, that engine takes no inputs_embeds for it).
GEMMA_SCALE = float(np.float32(math.sqrt(D)))
EXPECTED = {
    "llama": ("model.embed_tokens.weight", 1.0, 1.0, 1.0),
    "mistral": ("model.embed_tokens.weight", 1.0, 1.0, 1.0),
    "qwen2": ("model.embed_tokens.weight", 1.0, 1.0, 1.0),
    "gemma": ("model.embed_tokens.weight", GEMMA_SCALE, GEMMA_SCALE, 1.0),
    "gemma2": ("model.embed_tokens.weight", GEMMA_SCALE, GEMMA_SCALE, 1.0),
    "gemma3_text": ("model.embed_tokens.weight", GEMMA_SCALE, GEMMA_SCALE, GEMMA_SCALE),
    "gpt2": ("transformer.wte.weight", 1.0, 1.0, None),
    "bert": ("bert.embeddings.word_embeddings.weight", 1.0, None, None),
    "albert": ("albert.embeddings.word_embeddings.weight", 1.0, None, None),
    "t5": ("shared.weight", 1.0, None, None),
    "bart": ("model.shared.weight", math.sqrt(D), None, None),
}


@pytest.mark.parametrize("arch", list(MODELS))
def test_the_manifest_and_get_model_info_report_the_convention(
    arch: str, exported: _Exported, client: EmbeddingClient
) -> None:
    key, scale, vllm, sglang = EXPECTED[arch]
    manifest = json.loads((exported.dirs[arch] / "manifest.json").read_text())
    pretrained = manifest["pretrained"]
    assert pretrained["architecture"] == arch
    assert pretrained["keys"]["embedding_key"] == key
    assert manifest["source"]["key"] == key
    assert manifest["scale"] == pytest.approx(scale, rel=1e-7)
    info = client.info(arch)
    assert (info.architecture, info.convention) == (arch, pretrained["convention"])
    assert info.scale == manifest["scale"]
    assert info.engine_scales["transformers"] == info.scale
    for engine, expected in (("vllm", vllm), ("sglang", sglang)):
        if expected is None:
            assert engine not in info.engine_scales
            assert f"{engine} " not in info.convention
        else:
            assert info.engine_scales[engine] == pytest.approx(expected, rel=1e-7)
            # The convention names the engine's release its source was read in.
            assert f"{engine} {ENGINE_VERSIONS[engine]}" in info.convention
    assert arch in info.convention and "inputs_embeds" in info.convention


def test_findings_for_the_later_flags(exported: _Exported) -> None:
    """The output projection, final norm, segment table and factorization found."""
    keys = {
        arch: json.loads((exported.dirs[arch] / "manifest.json").read_text())["pretrained"]["keys"]
        for arch in MODELS
    }
    # Llama's head is untied (its config's default): the untied key, for --output-key.
    assert keys["llama"]["output_key"] == "lm_head.weight"
    norm = (keys["llama"]["norm_key"], keys["llama"]["norm_kind"])
    assert norm == ("model.norm.weight", "rmsnorm")
    assert keys["llama"]["norm_eps"] == exported.models["llama"].config.rms_norm_eps
    # Gemma's head is tied: no untied key; its RMSNorm multiplies by (1 + weight).
    assert "output_key" not in keys["gemma2"]
    assert keys["gemma2"]["output_projection"] == "lm_head.weight"
    assert keys["gemma2"]["norm_weight_offset"] == 1.0
    assert (keys["gpt2"]["norm_key"], keys["gpt2"]["norm_kind"]) == (
        "transformer.ln_f.weight", "layernorm",
    )  # fmt: skip
    assert keys["gpt2"]["norm_bias_key"] == "transformer.ln_f.bias"
    assert keys["bert"]["segment_key"] == "bert.embeddings.token_type_embeddings.weight"
    assert keys["albert"]["projection_key"] == "albert.encoder.embedding_hidden_mapping_in.weight"
    assert keys["t5"]["norm_key"] == "decoder.final_layer_norm.weight"
    assert keys["t5"]["output_scale"] == "d_model**-0.5"
    # The tie the exporter checked against the checkpoint (or its config's declaration).
    ties = {
        arch: json.loads((exported.dirs[arch] / "manifest.json").read_text())["tie"]["tied"]
        for arch in ("llama", "gemma2", "gpt2", "bert", "albert", "t5", "bart")
    }
    assert ties == {"llama": False, "gemma2": True, "gpt2": True, "bert": True, "albert": True,
                    "t5": True, "bart": True}  # fmt: skip
    # From the torch file, GPT-2's tie is the shared storage itself.
    tie = json.loads((exported.dirs["gpt2-bin"] / "manifest.json").read_text())["tie"]
    assert (tie["tied"], tie["evidence"]) == (True, "shared storage")


@pytest.mark.parametrize("arch", GENERATING)
def test_generation_from_served_vectors_equals_generation_from_ids(
    arch: str, exported: _Exported, client: EmbeddingClient
) -> None:
    """10 prompts of 3 to 11 ids, left-padded into one batch (their attention mask says
    which positions are real), generated greedily from the ids and from the vectors the
    server serves for those same ids."""
    model = exported.models[arch]
    rng = np.random.default_rng(99)
    lengths = rng.integers(3, 12, size=10)
    ids = np.zeros((10, int(lengths.max())), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, -length:] = rng.integers(1, V, size=length)
        mask[row, -length:] = 1
    served = torch.from_numpy(client.embed(ids, model=arch).copy())
    options = dict(
        max_new_tokens=8, min_new_tokens=8, do_sample=False,
        attention_mask=torch.from_numpy(mask), pad_token_id=0,
    )  # fmt: skip
    with torch.no_grad():
        from_ids = model.generate(input_ids=torch.from_numpy(ids), **options)
        from_embeds = model.generate(inputs_embeds=served, **options)
    # From ids the answer starts with the prompt; from inputs_embeds it does not.
    new = from_ids[:, ids.shape[1] :]
    assert new.shape == (10, 8), new.shape
    assert torch.equal(new, from_embeds), (new, from_embeds)
    # Prompts that all led to one answer would prove little of the vectors.
    answers = {tuple(row) for row in new.tolist()}
    assert len(answers) > 1, f"{arch}: every prompt generated {answers}"


def test_the_export_prints_what_it_found(exported: _Exported) -> None:
    printed = exported.printed["gemma2"]
    assert "gemma2: served vectors are E[id] * " in printed
    assert "; sglang takes E[id] unscaled and multiplies after" in printed
    vllm, sglang = ENGINE_VERSIONS["vllm"], ENGINE_VERSIONS["sglang"]
    assert f"(as read in vllm {vllm}, sglang {sglang})" in printed
    assert "final norm model.norm.weight: rmsnorm" in printed
    assert "segment table bert.embeddings.token_type_embeddings.weight" in exported.printed["bert"]


# --- the head: `nearest` through the model's own output table and final norm

# Per exported model: its final norm's module and the table its head reads.
HEADS = {"llama": ("model.norm", "output"), "llama-tied": ("model.norm", "embedding"),
         "gpt2": ("transformer.ln_f", "embedding")}  # fmt: skip


def _pre_norm_hidden(model: Any, norm: str, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The body's last hidden state as the final norm takes it (caught at its input), and
    the model's own logits for the same ids."""
    caught: list[torch.Tensor] = []
    hook = model.get_submodule(norm).register_forward_hook(
        lambda _module, inputs, _output: caught.append(inputs[0].detach().clone())
    )
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(ids)).logits
    finally:
        hook.remove()
    assert len(caught) == 1
    return caught[0], logits


@pytest.mark.parametrize("name", list(HEADS))
def test_nearest_with_the_norm_is_the_models_lm_head_of_its_norm(
    name: str, exported: _Exported, client: EmbeddingClient
) -> None:
    """``nearest(h, apply_norm=True)`` top-1 on the last pre-norm hidden state is
    transformers' ``lm_head(norm(h)).argmax()``, through the table the model's head reads
    (Llama untied: lm_head.weight; tied Llama and GPT-2: the embedding table)."""
    norm, table = HEADS[name]
    model = exported.models[name]
    manifest = json.loads((exported.dirs[name] / "manifest.json").read_text())
    assert (manifest["head"]["table"], manifest["head"]["norm"]["kind"]) == (
        table, "layernorm" if name == "gpt2" else "rmsnorm",
    )  # fmt: skip
    ids = np.random.default_rng(7).integers(0, V, size=(4, 12), dtype=np.int64)
    h, logits = _pre_norm_hidden(model, norm, ids)
    with torch.no_grad():
        want = model.lm_head(model.get_submodule(norm)(h))
    assert torch.allclose(want, logits, rtol=1e-5, atol=1e-5)  # the hook caught the right state
    answer = client.nearest(h.numpy(), k=1, apply_norm=True, model=name)
    assert answer.ids.shape == (4, 12, 1)
    assert np.array_equal(answer.ids[..., 0], want.argmax(-1).numpy()), name
    np.testing.assert_allclose(answer.scores[..., 0], want.amax(-1).numpy(), rtol=1e-4, atol=1e-4)
    # Without the norm the answer differs: the norm really was applied.
    bare = client.nearest(h.numpy(), k=1, model=name)
    assert not np.array_equal(bare.scores, answer.scores)


def test_a_norm_the_head_cannot_express_is_left_out_and_said(
    exported: _Exported, client: EmbeddingClient
) -> None:
    """Gemma's RMSNorm multiplies by (1 + weight) and tied T5 scales its output before the
    head: their heads are written without the norm, the export says so, and a request for
    the norm is refused rather than answered with the wrong one."""
    from tokembed.client.errors import InvalidInputError

    for name, why in (("gemma2", "multiplies by (1 + weight)"), ("t5", "d_model**-0.5")):
        manifest = json.loads((exported.dirs[name] / "manifest.json").read_text())
        assert manifest["head"]["table"] == "embedding" and manifest["head"].get("norm") is None
        note = [line for line in exported.printed[name].splitlines() if line.startswith("note:")]
        assert len(note) == 1 and why in note[0] and "without the final norm" in note[0], note
        h = np.random.default_rng(3).standard_normal((5, D)).astype(np.float32)
        with pytest.raises(InvalidInputError, match="no final norm"):
            client.nearest(h, apply_norm=True, model=name)
        table = exported.models[name].get_input_embeddings().weight.detach().numpy()
        answer = client.nearest(h, k=1, model=name)
        assert np.array_equal(answer.ids[:, 0], (h @ table.T).argmax(-1)), name


# --- bad input: one line each, and no model directory left behind


def _unknown_model(root: Path) -> Path:
    """A saved Llama whose config.json names an architecture tokembed does not know."""
    torch.manual_seed(0)
    saved = root / "unknown"
    MODELS["llama"]().save_pretrained(saved)
    config = json.loads((saved / "config.json").read_text())
    config["model_type"] = "falcon_h9"
    (saved / "config.json").write_text(json.dumps(config))
    return saved


def test_an_unknown_architecture_names_its_embedding_like_keys_and_the_manual_flags(
    tmp_path: Path, tokembed_main: Callable[..., Any], user_error: Callable[..., str]
) -> None:
    saved = _unknown_model(tmp_path)
    out = tmp_path / "out"
    proc = tokembed_main("export", "--from-pretrained", saved, "--out", out)
    user_error(
        proc,
        "config.json's model_type 'falcon_h9' is not one tokembed knows (albert, bart, bert,",
        f"embedding-like keys: lm_head.weight [{V}, {D}], model.embed_tokens.weight [{V}, {D}]",
        "export one with --weights DIR --key KEY",
    )
    assert not out.exists()


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--key", "model.embed_tokens.weight"], "--from-pretrained finds what --key would say"),
        (["--weights", "{saved}"], "--from-pretrained finds what --weights would say"),
        (["--segment-key", "x"], "--from-pretrained finds what --segment-key would say"),
        (["--output-key", "x"], "--from-pretrained finds what --output-key would say"),
        (["--norm-eps", "1e-5"], "--from-pretrained finds what --norm-eps would say"),
    ],
)
def test_flags_it_finds_itself_are_refused(
    extra: list[str], fragment: str, exported: _Exported, tmp_path: Path,
    tokembed_main: Callable[..., Any], user_error: Callable[..., str],
) -> None:  # fmt: skip
    saved = exported.root / "saved" / "llama"
    args = [a.replace("{saved}", str(saved)) for a in extra]
    proc = tokembed_main("export", "--from-pretrained", saved, "--out", tmp_path / "o", *args)
    user_error(proc, fragment)


def test_a_directory_without_config_json_is_refused(
    tmp_path: Path, tokembed_main: Callable[..., Any], user_error: Callable[..., str]
) -> None:
    (tmp_path / "bare").mkdir()
    proc = tokembed_main("export", "--from-pretrained", tmp_path / "bare", "--out", tmp_path / "o")
    user_error(proc, "no config.json", "give --weights and --key")
    proc = tokembed_main("export", "--from-pretrained", tmp_path / "nope", "--out", tmp_path / "o")
    user_error(proc, "nope: not a directory")


def test_the_v2_model_config_reports_the_convention(client: EmbeddingClient) -> None:
    import tritonclient.grpc as triton

    with triton.InferenceServerClient(client.target) as v2:
        config = v2.get_model_config("gemma2", as_json=True)["config"]
    parameters = {k: v["string_value"] for k, v in config["parameters"].items()}
    info = client.info("gemma2")
    assert parameters["architecture"] == "gemma2"
    assert parameters["convention"] == info.convention
    assert float(parameters["engine_scale_sglang"]) == 1.0
    assert float(parameters["engine_scale_vllm"]) == info.scale
    assert float(parameters["engine_scale_transformers"]) == info.scale
