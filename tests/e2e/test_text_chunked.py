"""EmbedTextChunked end to end: the real server, the real clients, a model exported with
its own tokenizer.

EmbedText's answer (input_ids, lengths, hidden_states) comes as a TensorsChunk header
naming each tensor, then their bytes in slices that span one tensor's end and the next's
start; the clients take it above ``chunked_threshold_bytes`` (bounded before the texts
are tokenized) and reassemble each tensor in place. Proved here: the answers are those of
the unary EmbedText, byte for byte, in each dtype; an answer over the client's message
limit comes whole in chunks; the stream is what the protocol says; bad texts are refused
by name while other requests are answered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tokembed.client import AsyncEmbeddingClient, EmbeddingClient
from tokembed.client.errors import InvalidInputError, RequestTooLargeError
from tokembed.v1 import embedding_pb2 as pb

from support.fixtures import TEXT_D
from support.requests import stub_for

MODEL = "text"
STRINGS = ["hello world", "", "привет мир 😀", "the quick brown fox jumps over the dog"] * 5
CHUNK_BYTES = 1000  # not a multiple of any tensor's size: slices span tensors' ends


def _chunked_calls(server: Any, code: str = "OK") -> float:
    labels = {"protocol": "tokembed.v1", "method": "EmbedTextChunked", "model": MODEL,
              "code": code}  # fmt: skip
    return float(server.metric("tokembed_requests_total", labels) or 0)


def test_clients_take_chunks_for_large_answers_and_get_the_unary_answer(
    text_model_dir: Path, start_server: Any
) -> None:
    server = start_server(text_model_dir, stream_chunk_bytes=CHUNK_BYTES)
    with EmbeddingClient(server.target, chunked_threshold_bytes=None) as unary:
        wanted = {dtype: unary.embed_text(STRINGS, dtype) for dtype in
                  ("float32", "float16", "bfloat16")}  # fmt: skip
        small = unary.embed_text(["hi"])
    assert _chunked_calls(server) == 0
    with EmbeddingClient(server.target, chunked_threshold_bytes=4096) as client:
        client.info()  # D learnt: these answers are past the threshold
        got = {dtype: client.embed_text(STRINGS, dtype) for dtype in wanted}
        # A tiny answer stays unary.
        tiny = client.embed_text(["hi"])
    assert _chunked_calls(server) == 3
    for dtype, result in got.items():
        for name in ("hidden_states", "input_ids", "lengths"):
            expected = getattr(wanted[dtype], name)
            assert getattr(result, name).dtype == expected.dtype
            np.testing.assert_array_equal(getattr(result, name), expected)
        assert result.hidden_states.shape == (int(result.lengths.sum()), TEXT_D)
        assert result.model_name == MODEL and result.timings.batch_tokens == len(result.input_ids)
    np.testing.assert_array_equal(tiny.hidden_states, small.hidden_states)


async def _async_embed_text(target: str) -> Any:
    async with AsyncEmbeddingClient(target, chunked_threshold_bytes=0) as client:
        await client.info()
        return await client.embed_text(STRINGS)


def test_an_answer_over_the_message_limit_comes_in_chunks(
    text_model_dir: Path, start_server: Any
) -> None:
    import asyncio

    server = start_server(text_model_dir, stream_chunk_bytes=CHUNK_BYTES)
    texts = ["word " * 20] * 200  # 200 texts of ~20 tokens x 32 x 4 bytes: ~0.5 MB of vectors
    limit = 64 * 1024
    with (
        EmbeddingClient(
            server.target, max_message_bytes=limit, chunked_threshold_bytes=None
        ) as unary,
        pytest.raises(RequestTooLargeError),
    ):
        unary.embed_text(texts)
    with EmbeddingClient(server.target) as reference:
        expected = reference.embed_text(texts)
    with EmbeddingClient(server.target, max_message_bytes=limit,
                         chunked_threshold_bytes=limit // 2) as client:  # fmt: skip
        client.info()
        got = client.embed_text(texts)
    np.testing.assert_array_equal(got.hidden_states, expected.hidden_states)
    assert got.hidden_states.nbytes > limit
    # The asyncio client, the same way.
    before = _chunked_calls(server)
    result = asyncio.run(_async_embed_text(server.target))
    assert _chunked_calls(server) == before + 1
    with EmbeddingClient(server.target, chunked_threshold_bytes=None) as unary:
        np.testing.assert_array_equal(result.hidden_states, unary.embed_text(STRINGS).hidden_states)


def test_the_stream_is_a_header_then_slices(text_model_dir: Path, start_server: Any) -> None:
    server = start_server(text_model_dir, stream_chunk_bytes=CHUNK_BYTES)
    request = pb.EmbedTextRequest(texts=[s.encode() for s in STRINGS], request_id="c1")
    with stub_for(server.target) as stub:
        chunks = list(stub.EmbedTextChunked(request))
        unary = stub.EmbedText(request)
    header = chunks[0]
    assert header.HasField("header") and not header.data
    names = [item.name for item in header.header.tensors]
    assert names == ["input_ids", "lengths", "hidden_states"]
    assert all(not item.tensor.data for item in header.header.tensors)
    assert header.header.request_id == "c1"
    slices = [chunk.data for chunk in chunks[1:]]
    assert all(not chunk.HasField("header") for chunk in chunks[1:])
    assert all(len(s) == CHUNK_BYTES for s in slices[:-1]) and 0 < len(slices[-1]) <= CHUNK_BYTES
    assert b"".join(slices) == b"".join(item.tensor.data for item in unary.tensors)


def test_bad_texts_are_refused_by_name_and_others_answered(
    text_model_dir: Path, start_server: Any
) -> None:
    server = start_server(text_model_dir, stream_chunk_bytes=CHUNK_BYTES)
    bad = pb.EmbedTextRequest(texts=[b"ok", b"\xffbad"])
    with stub_for(server.target) as stub:
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.EmbedTextChunked(bad))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "texts[1] is not valid UTF-8" in str(refused.value.details())
    assert _chunked_calls(server, "INVALID_ARGUMENT") == 1
    with EmbeddingClient(server.target, chunked_threshold_bytes=0) as client:
        client.info()
        with pytest.raises(InvalidInputError, match=r"texts\[0\] is not valid UTF-8"):
            client.embed_text([b"\xfe"])
        assert client.embed_text(["still answered"]).lengths.tolist()
