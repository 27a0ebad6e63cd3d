"""Tokenizers trained by the tests themselves with the ``tokenizers`` library (nothing is
downloaded): a byte-level BPE (GPT-2's kind), a WordPiece (BERT's) and a Unigram (T5's and
ALBERT's), each saved as the ``tokenizer.json`` Hugging Face writes; the strings they are
checked on (``texts``: several scripts, emoji, runs of whitespace, special tokens, the
empty string); and a model directory exported with one of them."""

from __future__ import annotations

import json
import random
from pathlib import Path

# Per script, a few words: what the corpus is made of, and what the strings are drawn from.
WORDS = {
    "latin": ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "Hello", "World"],
    "accented": ["café", "naïve", "façade", "über", "señor", "Ångström", "crème", "brûlée"],
    "cyrillic": ["привет", "мир", "слово", "текст", "Москва", "язык"],
    "greek": ["γειά", "σου", "κόσμε", "λόγος", "Ἀθῆναι"],
    "cjk": ["你好", "世界", "東京", "日本語", "한국어", "안녕하세요", "ひらがな", "カタカナ"],
    "arabic": ["مرحبا", "بالعالم", "كتاب", "שלום", "עולם"],
    "indic": ["नमस्ते", "दुनिया", "ভাষা", "தமிழ்"],
    "emoji": ["😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "❤️", "🤖", "✨", "🏳️‍🌈"],
    "other": ["2024", "3.14159", "e=mc²", "a+b", "#tag", "@user", "x_y", "(ok)", "—", "...", "'s"],
}
WHITESPACE = [" ", "  ", "   ", "\t", "\n", "\n\n", " \t ", "\r\n", "\u00a0", "\u3000"]

BPE_SPECIAL = ["<|endoftext|>"]
WORDPIECE_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
UNIGRAM_SPECIAL = ["<pad>", "</s>", "<unk>"]
SPECIAL = {"bpe": BPE_SPECIAL, "wordpiece": WORDPIECE_SPECIAL, "unigram": UNIGRAM_SPECIAL}


def texts(count: int, seed: int, special: list[str]) -> list[str]:
    """``count`` strings, the empty one first: words of every script, whitespace runs
    between (and around) them, now and then one of ``special`` inside."""
    rng = random.Random(seed)
    scripts = list(WORDS)
    out = [""]
    while len(out) < count:
        parts = []
        if rng.random() < 0.2:
            parts.append(rng.choice(WHITESPACE))
        for _ in range(rng.randint(1, 12)):
            roll = rng.random()
            if roll < 0.08:
                parts.append(rng.choice(special))
            elif roll < 0.12:
                parts.append(rng.choice(WHITESPACE) * rng.randint(1, 4))
            else:
                parts.append(rng.choice(WORDS[rng.choice(scripts)]))
            parts.append(rng.choice(WHITESPACE) if rng.random() < 0.3 else " ")
        if rng.random() < 0.5:
            parts.pop()
        out.append("".join(parts))
    return out


def corpus() -> list[str]:
    """What every tokenizer is trained on (no special tokens: trainers add those)."""
    return texts(2000, 1234, ["x"])


def train(kind: str, path: Path) -> Path:
    """Train a tokenizer of ``kind`` ("bpe", "wordpiece", "unigram") on ``corpus`` and save
    it at ``path`` (a tokenizer.json), with a tokenizer_config.json beside it naming
    transformers' generic fast tokenizer, so that ``AutoTokenizer`` loads the same file."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    if kind == "bpe":  # GPT-2's: byte-level BPE
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(
            vocab_size=600, special_tokens=BPE_SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )  # fmt: skip
    elif kind == "wordpiece":  # BERT's
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=600, special_tokens=WORDPIECE_SPECIAL)
    elif kind == "unigram":  # T5's and ALBERT's: SentencePiece's unigram over metaspace
        tokenizer = Tokenizer(models.Unigram())
        tokenizer.normalizer = normalizers.NFKC()
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(
            vocab_size=400, special_tokens=UNIGRAM_SPECIAL, unk_token="<unk>"
        )
    else:
        raise ValueError(kind)
    tokenizer.train_from_iterator(corpus(), trainer)
    if kind == "wordpiece":
        cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
        )  # fmt: skip
    elif kind == "unigram":
        eos = tokenizer.token_to_id("</s>")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos)]
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    config.update(_special_names(kind))
    (path.parent / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _special_names(kind: str) -> dict[str, str]:
    """The roles of the special tokens, as transformers' config names them."""
    if kind == "bpe":
        return {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
    if kind == "wordpiece":
        return {"unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                "pad_token": "[PAD]", "mask_token": "[MASK]"}  # fmt: skip
    return {"unk_token": "<unk>", "eos_token": "</s>", "pad_token": "<pad>"}


def export_with_tokenizer(
    out_dir: Path,
    tokenizer: Path,
    *,
    vocab_size: int = 1000,
    d_model: int = 32,
    extra: tuple[str, ...] = (),
) -> Path:
    """A seeded random model exported by the real command line, with ``--tokenizer``."""
    from tokembed.cli.main import main

    code = main([
        "export", "--out", str(out_dir), "--vocab-size", str(vocab_size), "--d-model",
        str(d_model), "--seed", "5", "--tokenizer", str(tokenizer), *extra,
    ])  # fmt: skip
    assert code == 0
    return out_dir
