"""Sequence-first ids and answers end to end: ``[S,B]`` in, ``[S,B,D]`` out (ragged:
``[S_max,B,D]``), through the real server and client, on each backend and in every
answer dtype; always the batch-first answer transposed, exactly."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokembed.client import AsyncEmbeddingClient, EmbeddingClient, InvalidInputError
from tokembed.v1 import embedding_pb2 as pb

from support.fixtures import EVERY_BACKEND, SMALL_D, SMALL_PAD, SMALL_V

DTYPES = ("float32", "float16", "bfloat16")


def same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    width = f"u{got.dtype.itemsize}"
    assert np.array_equal(
        np.ascontiguousarray(got).view(width), np.ascontiguousarray(want).view(width)
    )


@EVERY_BACKEND
@pytest.mark.parametrize("dtype", DTYPES)
def test_sequence_first_is_the_batch_first_answer_transposed(
    small_model_dir: Path, start_server: Any, backend: dict[str, int], dtype: str
) -> None:
    server = start_server(small_model_dir, **backend)
    rng = np.random.default_rng(5)
    with EmbeddingClient(server.target) as client:
        # Rectangular: small (sliced rows), large (gathered), one sequence, one position.
        for shape in ((7, 3), (600, 4), (9, 1), (1, 5)):
            ids = rng.integers(0, SMALL_V, size=shape)  # [S, B]
            hidden = client.embed(ids, dtype, sequence_first=True)
            assert hidden.shape == (*shape, SMALL_D)
            same_bits(hidden, client.embed(ids.T, dtype).transpose(1, 0, 2))
        # One sequence as a flat list: [S, 1].
        hidden = client.embed([4, 5, 6], dtype, sequence_first=True)
        same_bits(hidden, client.embed([[4, 5, 6]], dtype).transpose(1, 0, 2))
        # A list of equal sequences is a list of sequences, as batch-first: sent [S, B].
        sequences = [[1, 2, 3], [4, 5, 6]]
        hidden = client.embed(sequences, dtype, sequence_first=True)
        assert hidden.shape == (3, 2, SMALL_D)
        same_bits(hidden, client.embed(sequences, dtype).transpose(1, 0, 2))
        # Ragged: [S_max, B, D], padding (the padding id's row) past each sequence's end;
        # small and large, and a ragged set past the gather threshold.
        for lengths in ((3, 1, 2), (1, 700, 250, 1)):
            ragged = [rng.integers(0, SMALL_V, size=n).tolist() for n in lengths]
            result = client.embed_result(ragged, dtype, sequence_first=True)
            assert result.hidden_states.shape == (max(lengths), len(lengths), SMALL_D)
            assert result.lengths is not None and result.lengths.tolist() == list(lengths)
            batch_first = client.embed(ragged, dtype)
            same_bits(result.hidden_states, batch_first.transpose(1, 0, 2))
            # The shortest sequence's positions past its end hold the padding id's row.
            pad = client.embed([[SMALL_PAD]], dtype)[0, 0]
            shortest = int(np.argmin(lengths))
            past = result.hidden_states[lengths[shortest] :, shortest]
            same_bits(past, np.stack([pad] * (max(lengths) - lengths[shortest])))


@EVERY_BACKEND
def test_sequence_first_streams_and_chunks(
    small_model_dir: Path, start_server: Any, backend: dict[str, int]
) -> None:
    server = start_server(small_model_dir, **backend)
    ids = np.random.default_rng(6).integers(0, SMALL_V, size=(300, 8))
    ragged = [[1, 2, 3, 4], [5]]
    with EmbeddingClient(server.target) as client:
        want = client.embed(ids.T).transpose(1, 0, 2)
        want_ragged = client.embed(ragged, "bfloat16").transpose(1, 0, 2)
        streamed = list(client.embed_stream([ids, ragged], "float32", sequence_first=True))
        same_bits(streamed[0], want)
        assert streamed[1].shape == (4, 2, SMALL_D)
        same_bits(streamed[1], client.embed(ragged).transpose(1, 0, 2))
    # Past 512 bytes: the ragged answer, 4 x 2 x D bfloat16, is 1 KiB.
    with EmbeddingClient(server.target, chunked_threshold_bytes=512) as client:
        client.info()  # learn D, so that the client chunks
        same_bits(client.embed(ids, sequence_first=True), want)
        same_bits(client.embed(ragged, "bfloat16", sequence_first=True), want_ragged)
    assert server.metric("tokembed_requests_total", {"method": "EmbedChunked"}) == 2

    async def embed() -> np.ndarray:
        async with AsyncEmbeddingClient(server.target) as client:
            return await client.embed(ids, sequence_first=True)

    same_bits(asyncio.run(embed()), want)


def test_a_flat_sequence_first_answer_is_refused_by_client_and_server(
    small_model_dir: Path, start_server: Any
) -> None:
    server = start_server(small_model_dir)
    with EmbeddingClient(server.target) as client:
        with pytest.raises(InvalidInputError, match="no batch axis"):
            client.embed([[1, 2], [3]], layout="flat", sequence_first=True)
        # The server refuses it too, from any client: a raw request.
        request = pb.EmbedRequest(
            input_ids=pb.Tensor(dtype=pb.DTYPE_INT64, shape=[3], data=np.arange(3).tobytes()),
            lengths=[2, 1],
            ragged_layout=pb.RAGGED_LAYOUT_FLAT,
            layout=pb.LAYOUT_SEQUENCE_FIRST,
        )
        import grpc

        with grpc.insecure_channel(server.target) as channel:
            embed = channel.unary_unary(
                "/tokembed.v1.EmbeddingService/Embed",
                request_serializer=pb.EmbedRequest.SerializeToString,
                response_deserializer=pb.EmbedResponse.FromString,
            )
            with pytest.raises(grpc.RpcError) as caught:
                embed(request, timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no batch axis" in (caught.value.details() or "")
