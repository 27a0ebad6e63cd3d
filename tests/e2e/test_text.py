"""End to end, text in: the real server serving a model exported with its own tokenizer,
the real clients (blocking and asyncio), against transformers' tokenizer over the same
tokenizer.json and against Embed's own answers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokembed.client import (
    AsyncEmbeddingClient,
    EmbeddingClient,
    InvalidInputError,
    RequestTooLargeError,
)

from support.fixtures import TEXT_D, TEXT_MAX_LENGTH, TEXT_V
from support.text_models import WORDPIECE_SPECIAL, texts


@pytest.fixture(scope="module")
def hf_tokenizer(text_model_dir: Path, trained_tokenizers: dict[str, Path]) -> Any:
    """transformers' AutoTokenizer over the tokenizer.json the model was exported with."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(trained_tokenizers["wordpiece"].parent)


def _short(count: int, seed: int) -> list[str]:
    """Strings that fit the model's limit (TEXT_MAX_LENGTH tokens)."""
    return [text[:60] for text in texts(count, seed, WORDPIECE_SPECIAL)]


def test_tokenize_through_the_server_equals_transformers(
    text_model_dir: Path, start_server: Any, hf_tokenizer: Any
) -> None:
    strings = _short(300, 7)
    server = start_server(text_model_dir)
    with EmbeddingClient(server.target) as client:
        result = client.tokenize(strings)
        plain = client.tokenize(strings, add_special_tokens=False)
    expected = hf_tokenizer(strings, return_offsets_mapping=True, return_special_tokens_mask=True)
    assert result.ids() == expected["input_ids"]
    assert result.offset_pairs() == [[tuple(p) for p in o] for o in expected["offset_mapping"]]
    masks = [part.tolist() for part in np.split(result.special_tokens_mask,
                                                 np.cumsum(result.lengths)[:-1])]  # fmt: skip
    assert masks == [[bool(m) for m in mask] for mask in expected["special_tokens_mask"]]
    assert plain.ids() == hf_tokenizer(strings, add_special_tokens=False)["input_ids"]
    assert result.model_name == "text"


def test_detokenize_through_the_server_equals_transformers(
    text_model_dir: Path, start_server: Any, hf_tokenizer: Any
) -> None:
    strings = _short(200, 8)
    ids = hf_tokenizer(strings)["input_ids"]
    server = start_server(text_model_dir)
    with EmbeddingClient(server.target) as client:
        decoded = client.detokenize(ids)
        skipped = client.detokenize(ids, skip_special_tokens=True)
        rectangular = client.detokenize(np.array([[2, 40, 41, 3], [2, 42, 43, 3]]))
    assert decoded == hf_tokenizer.batch_decode(ids)
    assert skipped == hf_tokenizer.batch_decode(ids, skip_special_tokens=True)
    assert rectangular == hf_tokenizer.batch_decode([[2, 40, 41, 3], [2, 42, 43, 3]])


def test_embed_text_is_embed_of_its_own_ids(
    text_model_dir: Path, start_server: Any, hf_tokenizer: Any
) -> None:
    """The vectors of a text are exactly Embed's rows of the ids the tokenizer gives it,
    in every answer dtype; the ids are transformers'."""
    strings = _short(40, 9)
    server = start_server(text_model_dir)
    with EmbeddingClient(server.target) as client:
        for dtype in ("float32", "float16", "bfloat16"):
            result = client.embed_text(strings, dtype)
            assert result.hidden_states.shape == (int(result.lengths.sum()), TEXT_D)
            assert [s.tolist() for s in np.split(result.input_ids,
                                                 np.cumsum(result.lengths)[:-1])] == (
                hf_tokenizer(strings)["input_ids"]
            )  # fmt: skip
            rows = client.embed(result.input_ids.reshape(1, -1), dtype)[0]
            np.testing.assert_array_equal(result.hidden_states, rows)
            assert [len(s) for s in result.sequences()] == result.lengths.tolist()
            # Its timings count the texts' tokens, a batch of its own.
            assert result.timings.batch_tokens == int(result.lengths.sum())
            assert result.timings.batch_requests == 1


def test_the_asyncio_client_does_the_same(text_model_dir: Path, start_server: Any) -> None:
    server = start_server(text_model_dir)

    async def calls() -> tuple[Any, Any, Any]:
        async with AsyncEmbeddingClient(server.target) as client:
            return await asyncio.gather(
                client.tokenize("hello world"),
                client.embed_text(["hello world", ""]),
                client.detokenize([2, 40, 3]),
            )

    tokenized, embedded, texts_back = asyncio.run(calls())
    with EmbeddingClient(server.target) as client:
        assert tokenized.ids() == client.tokenize("hello world").ids()
        np.testing.assert_array_equal(
            embedded.hidden_states, client.embed_text(["hello world", ""]).hidden_states
        )
        assert texts_back == client.detokenize([[2, 40, 3]])


def test_model_info_says_whether_a_model_has_a_tokenizer(
    text_model_dir: Path, small_model_dir: Path, start_server: Any
) -> None:
    server = start_server((text_model_dir, small_model_dir))
    with EmbeddingClient(server.target) as client:
        text_info, small_info = client.info("text"), client.info("small")
    assert small_info.tokenizer is None
    assert text_info.tokenizer is not None
    assert text_info.tokenizer.model == "WordPiece"
    assert text_info.tokenizer.max_length == TEXT_MAX_LENGTH
    assert 0 < text_info.tokenizer.vocab_size <= TEXT_V
    manifest = (text_model_dir / "manifest.json").read_text()
    assert text_info.tokenizer.sha256 in manifest


# --- bad input: a clear error naming the value, and nothing else harmed


def test_invalid_utf8_is_refused_by_its_index_and_byte(
    text_model_dir: Path, start_server: Any
) -> None:
    server = start_server(text_model_dir)
    with EmbeddingClient(server.target) as client:
        for call in (client.tokenize, client.embed_text):
            with pytest.raises(InvalidInputError, match=r"texts\[1\] is not valid UTF-8: byte "
                               r"0xff at offset 3"):  # fmt: skip
                call(["fine", b"abc\xff"])
        assert client.tokenize("still serving").ids()  # the server goes on


def test_a_text_over_the_limit_is_refused_or_truncated_as_asked(
    text_model_dir: Path, start_server: Any, hf_tokenizer: Any
) -> None:
    long_text = " ".join(["the quick brown fox"] * 40)  # far over TEXT_MAX_LENGTH tokens
    server = start_server(text_model_dir)
    with EmbeddingClient(server.target) as client:
        for call in (client.tokenize, client.embed_text):
            with pytest.raises(RequestTooLargeError, match=rf"texts\[1\] is \d+ tokens, over "
                               rf"the model's limit of {TEXT_MAX_LENGTH}; shorten it, or ask "
                               "for truncation"):  # fmt: skip
                call(["short", long_text])
        truncated = client.tokenize(["short", long_text], truncation=True)
        embedded = client.embed_text(["short", long_text], truncation=True)
    expected = hf_tokenizer(["short", long_text], truncation=True, max_length=TEXT_MAX_LENGTH)
    assert truncated.ids() == expected["input_ids"]
    assert truncated.lengths.tolist()[1] == TEXT_MAX_LENGTH
    assert embedded.lengths.tolist() == truncated.lengths.tolist()


def test_a_request_over_the_server_limit_is_refused(
    text_model_dir: Path, start_server: Any
) -> None:
    server = start_server(text_model_dir, max_tokens_per_request=50)
    with EmbeddingClient(server.target) as client:
        with pytest.raises(RequestTooLargeError, match="over the limit of 50 per request"):
            client.embed_text(["hello world"] * 20)
        assert len(client.embed_text(["hello world"] * 5).lengths) == 5


def test_a_model_without_a_tokenizer_refuses_text_by_name(
    text_model_dir: Path, small_model_dir: Path, start_server: Any
) -> None:
    server = start_server((small_model_dir, text_model_dir))
    with EmbeddingClient(server.target) as client:
        for call in (client.tokenize, client.embed_text):
            with pytest.raises(InvalidInputError, match="model 'small' has no tokenizer"):
                call("hello", model="small")
        with pytest.raises(InvalidInputError, match="model 'small' has no tokenizer"):
            client.detokenize([1, 2], model="small")
        assert client.embed([[1, 2]], model="small").shape == (1, 2, 64)
        assert client.tokenize("hello", model="text").ids()


def test_ids_past_the_tokenizer_are_refused_by_detokenize(
    text_model_dir: Path, start_server: Any
) -> None:
    server = start_server(text_model_dir)
    with EmbeddingClient(server.target) as client:
        vocab = client.info().tokenizer
        assert vocab is not None
        size = vocab.vocab_size
        outside = rf"input_ids\[2\] = {size} is outside the tokenizer's vocabulary \[0, {size}\)"
        with pytest.raises(InvalidInputError, match=outside):
            client.detokenize([2, 40, size])
