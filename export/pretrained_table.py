"""What each Hugging Face architecture ``tokembed export --from-pretrained`` knows keeps
where, and what each engine expects of ``inputs_embeds``: one row per ``model_type``.

Read from each architecture's modeling code in the transformers the project tests with
(``transformers/models/<arch>/modeling_<arch>.py``) and from the engines' public source,
in the releases named by ``ENGINE_VERSIONS`` (vLLM: ``vllm/model_executor/models/<arch>.py``
and the runner that puts ``prompt_embeds`` in the model's ``inputs_embeds``; SGLang:
``python/sglang/srt/models/<arch>.py`` and its model runner). An engine's convention can
change between its releases (vLLM's Gemma 2 has), so each row holds for those releases;
docs/export.md ("From a Hugging Face model directory") has the same table for users, with
the file and the lines each row rests on.

Keys are matched by their dotted tail, so that a model saved with its head
(``model.embed_tokens.weight`` in ``LlamaForCausalLM``) and without it
(``embed_tokens.weight`` in ``LlamaModel``) are both found. The scale itself is not here:
``architecture.py`` computes it from the config (and the table's dtype, for Gemma), as it
did for ``--weights``.
"""

from __future__ import annotations

from dataclasses import dataclass

# The scale each engine's inputs_embeds expects the table's rows to carry, relative to
# what transformers' embedding module computes (the served vectors): the rows as
# transformers scales them, or the bare rows (the engine multiplies by sqrt(hidden) after
# taking inputs_embeds).
AS_SERVED = "as served"
UNSCALED = "unscaled"

TRANSFORMERS, VLLM, SGLANG = "transformers", "vllm", "sglang"
ENGINES = (TRANSFORMERS, VLLM, SGLANG)
# The engines' releases whose source the rows were read in (vLLM's wheel names its commit,
# 62d4bc3c7; SGLang's is the v0.5.23 tag).
ENGINE_VERSIONS = {VLLM: "0.34.0", SGLANG: "0.5.23"}


@dataclass(frozen=True)
class NormRule:
    """The model's final norm (before the output projection): the key's dotted tail, its
    kind, the config field of its epsilon, and what its weight is offset by (Gemma's
    RMSNorm multiplies by ``1 + weight``)."""

    key: str
    kind: str  # "rmsnorm" or "layernorm"
    eps_field: str
    weight_offset: float = 0.0
    bias_key: str | None = None


@dataclass(frozen=True)
class Row:
    """One architecture: where its keys are, and what the engines expect."""

    embedding: tuple[str, ...]  # the table's key tails, in order of preference
    width_field: str  # the config field that is the table's width
    output: str | None  # the output projection's key tail (its LM head), when it has one
    heads: tuple[str, ...]  # the config's `architectures` that have that output projection
    norm: NormRule | None
    # What happens to inputs_embeds inside the model, for the docs and the manifest.
    after: str
    # Per engine: AS_SERVED or UNSCALED; an engine absent does not take this
    # architecture's inputs_embeds (tokembed makes no payload for it).
    engines: dict[str, str]
    segment: str | None = None  # BERT's token type table
    segment_size_field: str | None = None
    projection: str | None = None  # ALBERT's factorization, [hidden, embedding_size]
    projection_bias: str | None = None
    output_scale_when_tied: str | None = None  # T5: the decoder output times d_model**-0.5


# vLLM's LlamaModel (Mistral's MistralModel subclasses it) and Qwen2Model, and SGLang's
# LlamaModel (MistralForCausalLM is its LlamaForCausalLM) and Qwen2Model, start from
# ``hidden_states = inputs_embeds`` and apply nothing to it before the first layer; their
# ``embed_tokens`` is a bare VocabParallelEmbedding, what the rows are.
_DECODER_ENGINES = {TRANSFORMERS: AS_SERVED, VLLM: AS_SERVED, SGLANG: AS_SERVED}
# SGLang's GemmaModel and Gemma2Model multiply by sqrt(hidden) after taking input_embeds
# (``hidden_states *= normalizer`` in their forward). vLLM 0.34.0 scales before, as
# transformers does: its Gemma2Model applies the normalizer in ``embed_input_ids`` and
# takes inputs_embeds as they come, and it runs Gemma through its Transformers backend,
# whose ``embed_input_ids`` is transformers' own scaled embedding module. (Older vLLM
# multiplied after in both, as SGLang does.) Both engines' Gemma 3 scale before.
_GEMMA_ENGINES = {TRANSFORMERS: AS_SERVED, VLLM: AS_SERVED, SGLANG: UNSCALED}
# Neither engine takes an encoder's embeddings: vLLM runs BERT in its encoder-only model
# state, which refuses --enable-prompt-embeds, has no T5 or ALBERT, and BART only in an
# out-of-tree plugin (not read); SGLang has no T5, BART or ALBERT, and its
# BertModel.forward ignores the input_embeds it is handed (it embeds input_ids).
_ENCODER_ENGINES = {TRANSFORMERS: AS_SERVED}
# SGLang's GPT2Model.forward takes no input_embeds (python/sglang/srt/models/gpt2.py).
_GPT2_ENGINES = {TRANSFORMERS: AS_SERVED, VLLM: AS_SERVED}


def _llama_like(heads: tuple[str, ...], norm: NormRule, engines: dict[str, str]) -> Row:
    return Row(
        embedding=("embed_tokens.weight",),
        width_field="hidden_size",
        output="lm_head.weight",
        heads=heads,
        norm=norm,
        after="the decoder layers take it as it is",
        engines=engines,
    )


_RMS = NormRule("norm.weight", "rmsnorm", "rms_norm_eps")
_GEMMA_RMS = NormRule("norm.weight", "rmsnorm", "rms_norm_eps", weight_offset=1.0)

ROWS: dict[str, Row] = {
    "llama": _llama_like(("LlamaForCausalLM",), _RMS, _DECODER_ENGINES),
    "mistral": _llama_like(("MistralForCausalLM",), _RMS, _DECODER_ENGINES),
    "qwen2": _llama_like(("Qwen2ForCausalLM",), _RMS, _DECODER_ENGINES),
    "gemma": _llama_like(("GemmaForCausalLM",), _GEMMA_RMS, _GEMMA_ENGINES),
    "gemma2": _llama_like(("Gemma2ForCausalLM",), _GEMMA_RMS, _GEMMA_ENGINES),
    "gemma3_text": _llama_like(
        ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), _GEMMA_RMS, _DECODER_ENGINES
    ),
    "gpt2": Row(
        embedding=("wte.weight",),
        width_field="n_embd",
        output="lm_head.weight",
        heads=("GPT2LMHeadModel", "GPT2DoubleHeadsModel"),
        norm=NormRule("ln_f.weight", "layernorm", "layer_norm_epsilon", bias_key="ln_f.bias"),
        after="the model adds its position embeddings (wpe)",
        engines=_GPT2_ENGINES,
    ),
    "bert": Row(
        embedding=("embeddings.word_embeddings.weight",),
        width_field="hidden_size",
        output="cls.predictions.decoder.weight",
        heads=("BertForMaskedLM", "BertForPreTraining", "BertLMHeadModel"),
        norm=None,
        after=(
            "the model adds its token type (segment) and position embeddings, then its "
            "embedding LayerNorm"
        ),
        engines=_ENCODER_ENGINES,
        segment="embeddings.token_type_embeddings.weight",
        segment_size_field="type_vocab_size",
    ),
    "albert": Row(
        embedding=("embeddings.word_embeddings.weight",),
        width_field="embedding_size",
        output="predictions.decoder.weight",
        heads=("AlbertForMaskedLM", "AlbertForPreTraining"),
        norm=None,
        after=(
            "the model adds its token type and position embeddings, its embedding "
            "LayerNorm, then projects embedding_size to hidden_size "
            "(encoder.embedding_hidden_mapping_in)"
        ),
        engines=_ENCODER_ENGINES,
        segment="embeddings.token_type_embeddings.weight",
        segment_size_field="type_vocab_size",
        projection="encoder.embedding_hidden_mapping_in.weight",
        projection_bias="encoder.embedding_hidden_mapping_in.bias",
    ),
    "t5": Row(
        embedding=("shared.weight", "encoder.embed_tokens.weight"),
        width_field="d_model",
        output="lm_head.weight",
        heads=("T5ForConditionalGeneration",),
        norm=NormRule("decoder.final_layer_norm.weight", "rmsnorm", "layer_norm_epsilon"),
        after="the encoder's layers take it as it is (T5 adds no position embedding)",
        engines=_ENCODER_ENGINES,
        output_scale_when_tied="d_model**-0.5",
    ),
    "bart": Row(
        embedding=("shared.weight", "encoder.embed_tokens.weight"),
        width_field="d_model",
        output="lm_head.weight",
        heads=("BartForConditionalGeneration",),
        norm=None,
        after="the model adds its learned position embeddings, then layernorm_embedding",
        engines=_ENCODER_ENGINES,
    ),
}
