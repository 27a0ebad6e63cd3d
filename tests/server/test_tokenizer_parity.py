"""Tokenizer parity: the server's tokenizer (``backends.tokenizer``, over the model
directory's tokenizer.json) against transformers' ``AutoTokenizer`` (its fast tokenizer
over the same file), on 10,000 strings (several scripts, emoji, runs of whitespace, special
tokens, the empty string) for a byte-level BPE (GPT-2's kind), a WordPiece (BERT's) and a
Unigram (T5's and ALBERT's), each trained here. Ids, offsets, special-token masks and
decoded texts must all be equal: every mismatch is counted, and the count must be 0.

In process (10,000 strings through the server would cost CI far more than it proves);
tests/e2e/test_text.py sends a smaller batch through the real server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokembed.server.backends.tokenizer import TextTokenizer

from support.text_models import SPECIAL, texts

STRINGS = 10_000
SEEDS = {"bpe": 1, "wordpiece": 2, "unigram": 3}


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "unigram"])
def test_ids_offsets_and_decoding_equal_transformers(
    kind: str, trained_tokenizers: dict[str, Path]
) -> None:
    from transformers import AutoTokenizer

    path = trained_tokenizers[kind]
    ours = TextTokenizer(path, max_length=1 << 20)
    theirs = AutoTokenizer.from_pretrained(path.parent)
    strings = texts(STRINGS, seed=SEEDS[kind], special=SPECIAL[kind])
    assert strings[0] == "" and len(set(strings)) > STRINGS // 2
    assert sum(any(token in s for token in SPECIAL[kind]) for s in strings) > STRINGS // 4

    mismatches: dict[str, int] = {}
    for add_special_tokens in (True, False):
        encoded = ours.encode(strings, add_special_tokens=add_special_tokens, truncate=False)
        expected = theirs(
            strings, add_special_tokens=add_special_tokens, return_offsets_mapping=True,
            return_special_tokens_mask=True,
        )  # fmt: skip
        ids, offsets, special = _split(encoded)
        _count(mismatches, f"ids {add_special_tokens}", ids, expected["input_ids"])
        _count(mismatches, f"offsets {add_special_tokens}", offsets,
               [[list(pair) for pair in each] for each in expected["offset_mapping"]])  # fmt: skip
        if not add_special_tokens:
            continue
        # With the special tokens (transformers' mask marks nothing without them), and
        # decoded with and without them.
        _count(mismatches, "special tokens", special, expected["special_tokens_mask"])
        for skip in (False, True):
            _count(mismatches, f"decode skip {skip}",
                   ours.decode(ids, skip_special_tokens=skip),
                   theirs.batch_decode(ids, skip_special_tokens=skip))  # fmt: skip
    assert mismatches == {}, f"{kind}: mismatches out of {STRINGS} strings: {mismatches}"
    # The decode round trip is the text itself where the tokenizer keeps every character
    # (byte-level BPE does; WordPiece lowercases, Unigram normalises).
    if kind == "bpe":
        plain = ours.encode(strings, add_special_tokens=False, truncate=False)
        assert ours.decode(_split(plain)[0], skip_special_tokens=False) == strings


def _split(encoded: Any) -> tuple[list[list[int]], list[list[list[int]]], list[list[int]]]:
    bounds = encoded.lengths.cumsum().tolist()
    starts = [0, *bounds[:-1]]
    return (
        [encoded.ids[a:b].tolist() for a, b in zip(starts, bounds, strict=True)],
        [encoded.offsets[a:b].tolist() for a, b in zip(starts, bounds, strict=True)],
        [encoded.special[a:b].tolist() for a, b in zip(starts, bounds, strict=True)],
    )


def _count(mismatches: dict[str, int], what: str, ours: list[Any], theirs: list[Any]) -> None:
    assert len(ours) == len(theirs) == STRINGS
    wrong = sum(a != b for a, b in zip(ours, theirs, strict=True))
    if wrong:
        mismatches[what] = wrong
