"""NearestChunked end to end: the real exporter's head, the real server, the real clients.

A nearest answer of several tensors (ids, scores and the logits ``[N, V]``) comes as a
header naming every tensor, then the tensors' bytes in slices that span one tensor's end
and the next's start; the clients take it above ``chunked_threshold_bytes`` and
reassemble each tensor in place. Proved here: the answers are those of the unary
``Nearest`` (and of numpy's multiply), byte for byte; the stream's messages are what
the protocol says (a header without data, slices of at most ``stream_chunk_bytes``);
bad input is INVALID_ARGUMENT naming the value while other requests are answered."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tokembed.client import AsyncEmbeddingClient, EmbeddingClient
from tokembed.client.errors import InvalidInputError, RequestTooLargeError
from tokembed.export.head import add_head
from tokembed.export.modules import random_table
from tokembed.v1 import embedding_pb2 as pb

from support.models import export_model_dir
from support.requests import stub_for

V, D = 700, 16
CHUNK_BYTES = 1000  # not a multiple of any tensor's size: slices span tensors' ends
CHUNKED_ABOVE = 1024  # every answer with logits here is past it


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = export_model_dir(
        tmp_path_factory.mktemp("nearest-chunked") / "m", vocab_size=V, d_model=D, seed=5,
        name="m",
    )  # fmt: skip
    add_head(directory, output_table=None, output_key=None, norm=None)
    return directory


def _table() -> np.ndarray:
    return random_table(V, D, 5, None).float().numpy()


def _top(logits: np.ndarray, k: int) -> np.ndarray:
    """The ids of the ``k`` largest, equal ones by the lower id."""
    return np.argsort(-logits, axis=-1, kind="stable")[..., :k]


def _request(h: np.ndarray, k: int, *, logits: bool = True, **fields: Any) -> pb.NearestRequest:
    return pb.NearestRequest(
        vectors=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=list(h.shape), data=h.tobytes()),
        k=k, metric=pb.METRIC_DOT, logits=logits, **fields,
    )  # fmt: skip


def _chunked_calls(server: Any, code: str = "OK") -> float:
    labels = {"protocol": "tokembed.v1", "method": "NearestChunked", "model": "m", "code": code}
    return float(server.metric("tokembed_requests_total", labels) or 0)


def test_clients_take_chunks_for_large_answers_and_get_the_unary_answer(
    tied: Path, start_server: Any
) -> None:
    server = start_server(tied, stream_chunk_bytes=CHUNK_BYTES)
    rng = np.random.default_rng(3)
    batches = [rng.standard_normal(shape).astype(np.float32) for shape in
               [(5, D), (2, 3, D), (1, D), (9, D)]]  # fmt: skip
    with EmbeddingClient(server.target, chunked_threshold_bytes=None) as unary:
        wanted = [unary.nearest(h, k=7, logits=True) for h in batches]
    assert _chunked_calls(server) == 0
    with EmbeddingClient(server.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client:
        client.info()  # V learnt: every answer with logits here is asked for in chunks
        got = [client.nearest(h, k=7, logits=True, request_id=f"r{i}")
               for i, h in enumerate(batches)]  # fmt: skip
        # Without logits, 7 ids and scores a vector stay under the threshold: unary.
        small = client.nearest(batches[0], k=7)
    assert _chunked_calls(server) == len(batches)
    table = _table()
    for i, (h, want, found) in enumerate(zip(batches, wanted, got, strict=True)):
        assert found.request_id == f"r{i}" and found.model_name == "m"
        np.testing.assert_array_equal(found.ids, want.ids)
        np.testing.assert_array_equal(found.scores, want.scores)
        np.testing.assert_array_equal(found.logits, want.logits)
        assert found.ids.dtype == np.int64 and found.logits is not None
        assert found.logits.shape == (*h.shape[:-1], V)
        reference = h @ table.T
        np.testing.assert_allclose(found.logits, reference, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(
            found.ids, np.argsort(-reference, axis=-1, kind="stable")[..., :7]
        )
        assert found.logits.flags.writeable  # reassembled in place, not a view of bytes
    np.testing.assert_array_equal(small.ids, wanted[0].ids)
    assert _chunked_calls(server) == len(batches)


def test_the_first_logits_answer_teaches_v_and_ids_alone_chunk_by_their_size(
    tied: Path, start_server: Any
) -> None:
    server = start_server(tied, stream_chunk_bytes=CHUNK_BYTES)
    h = np.random.default_rng(4).standard_normal((40, D)).astype(np.float32)
    with EmbeddingClient(server.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client:
        first = client.nearest(h, k=3, logits=True)  # V not known yet: unary
        assert _chunked_calls(server) == 0
        second = client.nearest(h, k=3, logits=True)  # V learnt from the first
        assert _chunked_calls(server) == 1
        # 40 vectors x 3 x 12 bytes = 1440 > 1024: ids and scores alone chunk too.
        third = client.nearest(h, k=3)
        assert _chunked_calls(server) == 2 and third.logits is None
    np.testing.assert_array_equal(second.logits, first.logits)
    np.testing.assert_array_equal(third.ids, first.ids)
    np.testing.assert_array_equal(third.scores, first.scores)


def test_the_stream_is_a_header_then_slices_of_the_tensors_in_turn(
    tied: Path, start_server: Any
) -> None:
    server = start_server(tied, stream_chunk_bytes=CHUNK_BYTES)
    h = np.random.default_rng(5).standard_normal((6, D)).astype(np.float32)
    with stub_for(server.target) as stub:
        unary = stub.Nearest(_request(h, 4, request_id="u"), timeout=30)
        chunks = list(stub.NearestChunked(_request(h, 4, request_id="c"), timeout=30))
    header = chunks[0]
    assert header.HasField("header") and not header.data
    assert header.header.request_id == "c" and header.header.model_name == "m"
    described = [(t.name, t.tensor.dtype, list(t.tensor.shape)) for t in header.header.tensors]
    assert described == [
        ("ids", pb.DTYPE_INT64, [6, 4]), ("scores", pb.DTYPE_FLOAT32, [6, 4]),
        ("logits", pb.DTYPE_FLOAT32, [6, V]),
    ]  # fmt: skip
    assert all(not t.tensor.data for t in header.header.tensors)
    slices = [chunk.data for chunk in chunks[1:]]
    assert all(not chunk.HasField("header") for chunk in chunks[1:])
    assert all(len(data) == CHUNK_BYTES for data in slices[:-1]) and len(slices[-1]) > 0
    assert b"".join(slices) == b"".join(t.tensor.data for t in unary.tensors)


def test_bad_input_in_chunks_fails_alone_and_names_the_value(tied: Path, start_server: Any) -> None:
    server = start_server(tied, stream_chunk_bytes=CHUNK_BYTES)
    rng = np.random.default_rng(6)
    good = [rng.standard_normal((8, D)).astype(np.float32) for _ in range(6)]
    nan = good[0].copy()
    nan[3, 2] = np.nan

    async def run() -> list[Any]:
        async with AsyncEmbeddingClient(
            server.target, chunked_threshold_bytes=CHUNKED_ABOVE
        ) as client:
            await client.info()
            calls = [client.nearest(h, k=5, logits=True) for h in good]
            calls += [
                client.nearest(nan, k=5, logits=True),
                client.nearest(good[1], k=0, logits=True),
                client.nearest(good[2][:, :7].copy(), k=5, logits=True),
                client.nearest(good[3], k=V + 1, logits=True),
            ]
            return await asyncio.gather(*calls, return_exceptions=True)

    answers = asyncio.run(asyncio.wait_for(run(), 60))
    table = _table()
    for h, found in zip(good, answers[: len(good)], strict=True):
        assert not isinstance(found, BaseException), found
        reference = h @ table.T
        np.testing.assert_array_equal(
            found.ids, np.argsort(-reference, axis=-1, kind="stable")[:, :5]
        )
        np.testing.assert_allclose(found.logits, reference, rtol=1e-5, atol=1e-5)
    refusals = answers[len(good) :]
    assert all(isinstance(error, InvalidInputError) for error in refusals), refusals
    messages = [str(error) for error in refusals]
    assert "vectors[3,2] = nan is not finite" in messages[0]
    assert "k = 0 is outside [1, 700]" in messages[1]
    assert "has D = 7, but model 'm' has d_model 16" in messages[2]
    assert f"k = {V + 1} is outside [1, 700]" in messages[3]
    assert _chunked_calls(server) == len(good)
    assert _chunked_calls(server, "INVALID_ARGUMENT") == 4
    # A raw NearestChunked call that is refused ends its stream with the status alone.
    with stub_for(server.target) as stub, pytest.raises(grpc.RpcError) as caught:
        list(stub.NearestChunked(_request(good[0], 0), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "k = 0 is outside" in str(caught.value.details())


def test_an_answer_over_the_limit_is_refused_before_it_is_computed(
    tied: Path, start_server: Any
) -> None:
    # 100 vectors' answer is 282,400 bytes: over a limit of 200,000, in chunks or not.
    server = start_server(tied, max_output_bytes_per_request=200_000)
    h = np.random.default_rng(7).standard_normal((100, D)).astype(np.float32)
    with EmbeddingClient(server.target, chunked_threshold_bytes=CHUNKED_ABOVE) as client:
        client.info()
        with pytest.raises(RequestTooLargeError) as too_large:
            client.nearest(h, k=2, logits=True)
        fits = client.nearest(h[:50], k=2, logits=True)
    assert "response would be 282400 bytes, over the limit of 200000" in str(too_large.value)
    assert fits.logits is not None and fits.logits.shape == (50, V)
    assert _chunked_calls(server, "RESOURCE_EXHAUSTED") == 1
