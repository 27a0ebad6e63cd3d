"""nearest end to end: the real exporter's head, the real server, the real clients.

- exact: 1,000 random vectors per dtype (float32, float16, bfloat16 tables, vectors in
  the same dtype): the ids are ``torch.topk(h @ E.T)``'s with both widened to float32
  (float32 accumulation, torch's CPU matmul), the scores within 1e-5 relative; cosine
  likewise (``normalize(h) @ normalize(E).T``);
- round trip: every one of the built-in default model's 32,000 ids is its own embedding's
  cosine top-1;
- batching: concurrent callers' vectors share a multiply, and each gets what it gets alone;
- bad input (wrong D, NaN, Inf, k = 0, k past the limit and past V, the wrong dtype, a
  model without a head): INVALID_ARGUMENT naming the value, while the good requests sent
  with them are answered exactly.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from tokembed.client import AsyncEmbeddingClient, EmbeddingClient
from tokembed.client.errors import DeadlineExceededError, InvalidInputError, OverloadedError
from tokembed.export.head import add_head
from tokembed.export.modules import random_table
from tokembed.v1 import embedding_pb2 as pb

from support.backends import HookedLoader, entered
from support.metrics import scrape, total
from support.models import build_default_model_dir, default_model_rows, export_model_dir

V, D = 1000, 64
DTYPES = ["float32", "float16", "bfloat16"]
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tied head over a seeded table in each dtype, and a model without a head."""
    root = tmp_path_factory.mktemp("nearest")
    made = {}
    for dtype in DTYPES:
        directory = export_model_dir(
            root / dtype, vocab_size=V, d_model=D, seed=3, dtype=dtype, name=f"tied-{dtype}"
        )
        add_head(directory, output_table=None, output_key=None, norm=None)
        made[dtype] = directory
    made["plain"] = export_model_dir(root / "plain", vocab_size=V, d_model=D, name="plain")
    return made


def _table(dtype: str) -> torch.Tensor:
    """E as stored: the exporter's seeded table rounded to ``dtype`` (then widened)."""
    return random_table(V, D, 3, None).to(TORCH[dtype]).float()


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_against_torch_topk(models, start_server, dtype):
    server = start_server(tuple(models[d] for d in DTYPES))
    generator = torch.Generator().manual_seed(11)
    h = torch.randn(1000, D, generator=generator).to(TORCH[dtype])
    table = _table(dtype)
    sent = h.float().numpy() if dtype == "float32" else h.view(torch.int16).numpy()
    if dtype != "float32":  # the client sends float16 / ml_dtypes.bfloat16 arrays as they are
        import ml_dtypes

        sent = sent.view(np.float16 if dtype == "float16" else ml_dtypes.bfloat16)
    with EmbeddingClient(server.target) as client:
        dot = client.nearest(sent, k=5, model=f"tied-{dtype}")
        cosine = client.nearest(sent, k=5, metric="cosine", model=f"tied-{dtype}")
    want_scores, want_ids = torch.topk(h.float() @ table.T, 5)
    np.testing.assert_array_equal(dot.ids, want_ids.numpy())
    np.testing.assert_allclose(dot.scores, want_scores.numpy(), rtol=1e-5)
    normalize = torch.nn.functional.normalize
    cos_scores, cos_ids = torch.topk(normalize(h.float()) @ normalize(table).T, 5)
    np.testing.assert_array_equal(cosine.ids, cos_ids.numpy())
    np.testing.assert_allclose(cosine.scores, cos_scores.numpy(), rtol=1e-5)
    assert dot.ids.shape == dot.scores.shape == (1000, 5) and dot.logits is None


def test_logits_and_three_dimensional_vectors(models, start_server):
    server = start_server(models["float32"])
    h = np.random.default_rng(5).standard_normal((2, 3, D)).astype(np.float32)
    with EmbeddingClient(server.target) as client:
        found = client.nearest(h, k=4, logits=True)
        info = client.info()
    want = h @ _table("float32").numpy().T
    assert found.ids.shape == (2, 3, 4) and found.logits is not None
    assert found.logits.shape == (2, 3, V)
    np.testing.assert_allclose(found.logits, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(found.ids, np.argsort(-want, axis=-1)[..., :4])
    assert info.head is not None and (info.head.table, info.head.norm) == ("embedding", "")
    assert info.head.max_k == V  # the server's limit (1024) is past V
    # The look-up's tables hold E * sqrt(D), not the head's E: the head maps the stored
    # table (float32 here), and GetModelInfo says so.
    assert info.memory_bytes["float32 head table (mapped)"] == V * D * 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_head_of_scale_one_reads_the_look_ups_own_table(tmp_path, start_server, dtype):
    """Scale 1: the look-up's table of the stored dtype holds the head's bytes, and the
    head reads it (GetModelInfo lists no table of the head's own); answers stay exact."""
    from tokembed.export.modules import TokenEmbedding
    from tokembed.export.pipeline import ExportOptions, export_model

    table = random_table(V, D, 3, None)
    module = TokenEmbedding(V, D, padding_idx=None, weight=table, scale=1.0)
    directory = tmp_path / dtype
    export_model(module, ExportOptions(out_dir=directory, name="one", weight_dtype=dtype, seed=3))
    add_head(directory, output_table=None, output_key=None, norm=None)
    server = start_server(directory)
    h = np.random.default_rng(8).standard_normal((50, D)).astype(np.float32)
    with EmbeddingClient(server.target) as client:
        found = client.nearest(h, k=3)
        info = client.info()
    assert not [key for key in info.memory_bytes if "head" in key], info.memory_bytes
    # mapped from the table cache (on by default)
    assert info.memory_bytes[f"mapped {dtype} table"] == V * D * (4 if dtype == "float32" else 2)
    stored = table.to(TORCH[dtype]).double()
    exact = torch.from_numpy(h).double() @ stored.T
    np.testing.assert_array_equal(found.ids, torch.topk(exact, 3).indices.numpy())


def test_round_trip_of_every_id_of_the_default_model(tmp_path, start_server):
    """Each of the 32,000 rows' cosine top-1 is its own id (the rows are distinct). The
    rows sent are the model's answers (E * sqrt(D), computed independently of the
    exporter): cosine does not see the scale. Sent by 32 concurrent callers of 1,000 rows
    (2 MB each: the largest request the server's receive limit takes at the default
    max_tokens_per_request); the cost is the multiply, 2 x 32,000 x 512 x 32,000 flops."""
    directory = build_default_model_dir(tmp_path / "default")
    add_head(directory, output_table=None, output_key=None, norm=None)
    rows = default_model_rows()
    server = start_server(directory)

    async def every_id() -> list[np.ndarray]:
        async with AsyncEmbeddingClient(server.target, timeout_s=300) as client:
            calls = [client.nearest(rows[start : start + 1000], k=1, metric="cosine")
                     for start in range(0, len(rows), 1000)]  # fmt: skip
            return [found.ids for found in await asyncio.gather(*calls)]

    ids = np.concatenate(asyncio.run(every_id()))
    np.testing.assert_array_equal(ids[:, 0], np.arange(32000))


async def _until_queued(server, vectors: int, timeout_s: float = 30) -> None:
    """Wait until ``vectors`` vectors wait in the model's batcher (its queue gauge)."""
    loop = asyncio.get_running_loop()
    stop = loop.time() + timeout_s
    while await asyncio.to_thread(server.metric, "tokembed_queued_tokens") != vectors:
        assert loop.time() < stop, "the requests never all queued"
        await asyncio.sleep(0.01)


async def _until_ended(server, requests: int, timeout_s: float = 30) -> None:
    """Wait until ``requests`` nearest requests have ended (whatever their status)."""
    loop = asyncio.get_running_loop()
    stop = loop.time() + timeout_s
    labels = {"operation": "nearest"}
    while await asyncio.to_thread(server.metric, "tokembed_requests_total", labels) < requests:
        assert loop.time() < stop, "the requests never ended"
        await asyncio.sleep(0.01)


def test_concurrent_callers_share_a_multiply(tmp_path, start_server):
    """16 callers of 8 vectors, queued while a first search is held: their rows go into
    one multiply (the head sees one search of 16 queries; each answer says so), and each
    answer is the one it gets alone. Deterministic: nothing depends on timing."""
    directory = build_default_model_dir(tmp_path / "default")
    add_head(directory, output_table=None, output_key=None, norm=None)
    loader = HookedLoader(open_look_ups=False)
    server = start_server(directory, loader=loader, max_concurrent_batches=1)
    rng = np.random.default_rng(9)
    vectors = [rng.standard_normal((8, 512)).astype(np.float32) for _ in range(16)]

    async def together() -> list:
        async with AsyncEmbeddingClient(server.target) as client:
            first = asyncio.ensure_future(client.nearest(vectors[0][:1], k=3))
            assert loader.backend is not None
            await entered(loader.backend)  # the first search holds the only batch slot
            calls = [asyncio.ensure_future(client.nearest(v, k=3)) for v in vectors]
            await _until_queued(server, 16 * 8)
            loader.look_up_gate.open()
            await first
            return list(await asyncio.gather(*calls))

    answers = asyncio.run(together())
    assert loader.backend is not None
    assert loader.backend.searches == [[1], [8] * 16]
    assert [a.timings.batch_requests for a in answers] == [16] * 16
    with EmbeddingClient(server.target) as client:
        alone = [client.nearest(v, k=3) for v in vectors]
    for batched, single in zip(answers, alone, strict=True):
        assert single.timings.batch_requests == 1
        np.testing.assert_array_equal(batched.ids, single.ids)
        np.testing.assert_array_equal(batched.scores, single.scores)
    text = scrape(server.metrics_port, timeout_s=5)
    assert total(text, "tokembed_requests_total", {"operation": "nearest", "code": "OK"}) == 33


def test_deadline_and_cancellation_leave_the_batch_to_the_others(models, start_server):
    """While a search is held: one request's deadline passes in the queue
    (DEADLINE_EXCEEDED), one is cancelled by its caller (its place freed: no multiply
    holds its rows), and the two others of the same batch are answered exactly."""
    loader = HookedLoader(open_look_ups=False)
    server = start_server(models["float32"], loader=loader, max_concurrent_batches=1)
    rng = np.random.default_rng(4)
    late, kept, cancelled, other = (rng.standard_normal((n, D)).astype(np.float32)
                                    for n in (3, 5, 7, 2))  # fmt: skip

    async def run() -> tuple:
        async with AsyncEmbeddingClient(server.target, retries=0) as client:
            first = asyncio.ensure_future(client.nearest(late[:1], k=2))
            assert loader.backend is not None
            await entered(loader.backend)
            good = asyncio.ensure_future(client.nearest(kept, k=2))
            gone = asyncio.ensure_future(client.nearest(cancelled, k=2))
            more = asyncio.ensure_future(client.nearest(other, k=2))
            await _until_queued(server, 5 + 7 + 2)
            # Queued or not by the time it passes, its deadline fails it, never the batch.
            timed = asyncio.ensure_future(client.nearest(late, k=2, timeout_s=1.0))
            gone.cancel()
            with pytest.raises(DeadlineExceededError):
                await timed
            # The server's own end of both calls (its deadline may pass a moment after the
            # client's): counted, as every request is when it ends.
            await _until_ended(server, 2)
            loader.look_up_gate.open()
            await first
            return await good, await more, gone.cancelled()

    good, more, was_cancelled = asyncio.run(run())
    assert was_cancelled
    assert loader.backend is not None
    # The batch after the held one multiplied the two live requests' rows only.
    assert loader.backend.searches == [[1], [5, 2]]
    with EmbeddingClient(server.target) as client:
        for vectors, answer in ((kept, good), (other, more)):
            alone = client.nearest(vectors, k=2)
            np.testing.assert_array_equal(answer.ids, alone.ids)
            np.testing.assert_array_equal(answer.scores, alone.scores)
    assert server.metric("tokembed_queued_tokens") == 0


def test_admission_counts_nearest_work_not_vectors(models, start_server):
    """The queue bound of nearest is its work, 2 N D V flops: with room for 6 queued
    vectors' work, a request of 5 is admitted behind 1 queued, one of 7 refused at once
    with RESOURCE_EXHAUSTED, while the token bound (here 4) does not count vectors."""
    per_vector = 2 * D * V
    loader = HookedLoader(open_look_ups=False)
    server = start_server(
        models["float32"], loader=loader, max_concurrent_batches=1, max_queued_tokens=4,
        max_queued_nearest_flops=6 * per_vector,
    )  # fmt: skip
    rng = np.random.default_rng(12)
    one, five, seven = (rng.standard_normal((n, D)).astype(np.float32) for n in (1, 5, 7))

    async def run() -> tuple:
        async with AsyncEmbeddingClient(server.target, retries=0) as client:
            first = asyncio.ensure_future(client.nearest(one, k=1))
            assert loader.backend is not None
            await entered(loader.backend)  # computing: not queued
            queued = asyncio.ensure_future(client.nearest(one, k=1))
            await _until_queued(server, 1)
            with pytest.raises(OverloadedError) as refused:
                await client.nearest(seven, k=1)
            admitted = asyncio.ensure_future(client.nearest(five, k=1))
            await _until_queued(server, 6)
            loader.look_up_gate.open()
            await first
            return await queued, await admitted, str(refused.value)

    _, admitted, message = asyncio.run(run())
    assert f"{per_vector} flops of work queued, {7 * per_vector} more" in message
    assert f"limit of {6 * per_vector}" in message
    assert admitted.ids.shape == (5, 1)


def _raw(server, request: pb.NearestRequest) -> grpc.RpcError:
    with grpc.insecure_channel(server.target) as channel:
        call = channel.unary_unary(
            "/tokembed.v1.EmbeddingService/Nearest",
            request_serializer=pb.NearestRequest.SerializeToString,
            response_deserializer=pb.TensorsResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as caught:
            call(request, timeout=30)
    return caught.value


def test_bad_input_fails_alone_and_names_the_value(models, start_server):
    server = start_server((models["float32"], models["plain"]), max_delay_ms=20.0)
    rng = np.random.default_rng(2)
    good = [rng.standard_normal((4, D)).astype(np.float32) for _ in range(6)]
    nan = good[0].copy()
    nan[2, 7] = np.nan
    inf = good[1].copy()
    inf[0, 3] = -np.inf
    bad = [
        (dict(vectors=good[0][:, :10]), "has D = 10, but model 'tied-float32' has d_model 64"),
        (dict(vectors=nan), "vectors[2,7] = nan is not finite"),
        (dict(vectors=inf), "vectors[0,3] = -inf is not finite"),
        (dict(vectors=good[0], k=0), "k = 0 is outside [1, 1000]"),
        (dict(vectors=good[0], k=1001), "k = 1001 is outside [1, 1000]"),
        (dict(vectors=good[0], model="plain"), "model 'plain' cannot answer nearest"),
        (dict(vectors=good[0], apply_norm=True), "has no final norm"),
    ]

    async def mixed() -> list:
        async with AsyncEmbeddingClient(server.target) as client:
            calls = [client.nearest(v, k=5) for v in good]
            calls += [client.nearest(**{"k": 5, **args}) for args, _ in bad]
            return list(await asyncio.gather(*calls, return_exceptions=True))

    results = asyncio.run(mixed())
    with EmbeddingClient(server.target) as client:
        for vectors, answer in zip(good, results, strict=False):
            alone = client.nearest(vectors, k=5)
            np.testing.assert_array_equal(answer.ids, alone.ids)
            np.testing.assert_array_equal(answer.scores, alone.scores)
    for (_, message), error in zip(bad, results[len(good) :], strict=True):
        assert isinstance(error, InvalidInputError), error
        assert message in str(error)

    # What the client cannot send: vectors of a dtype the operation does not take, and
    # k past the server's limit on a larger vocabulary (here V bounds it).
    ints = pb.Tensor(dtype=pb.DTYPE_INT32, shape=[1, D], data=b"\0" * 4 * D)
    error = _raw(server, pb.NearestRequest(vectors=ints, k=1))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "vectors dtype 'DTYPE_INT32' is not supported" in error.details()
    vectors = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, D], data=b"\0" * 4 * D)
    error = _raw(server, pb.NearestRequest(vectors=vectors, k=1, metric=pb.METRIC_COSINE))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "vectors[0] is all zeros" in error.details()
    with EmbeddingClient(server.target) as client:  # still serving
        assert client.nearest(good[0], k=1).ids.shape == (4, 1)


def test_k_past_the_servers_limit(models, start_server):
    server = start_server(models["float32"], max_nearest_k=16)
    with EmbeddingClient(server.target) as client, pytest.raises(InvalidInputError) as caught:
        client.nearest(np.ones((1, D), np.float32), k=17)
    assert "k = 17 is outside [1, 16] (the limit is min(max_nearest_k 16, V 1000))" in str(
        caught.value
    )


def test_the_command_line(models, start_server, tmp_path, capsys):
    from tokembed.cli.main import main

    server = start_server(models["float32"])
    h = np.random.default_rng(6).standard_normal((3, D)).astype(np.float32)
    np.save(tmp_path / "h.npy", h)
    argv = ["nearest", "--target", server.target, "--vectors", str(tmp_path / "h.npy")]
    assert main([*argv, "--k", "2", "--logits", "--output", str(tmp_path / "found.npz")]) == 0
    out = capsys.readouterr().out
    want = np.argsort(-(h @ _table("float32").numpy().T), axis=1)[:, :2]
    assert f"vector 0: {want[0, 0]} (" in out and "saved ids, scores, logits" in out
    saved = np.load(tmp_path / "found.npz")
    np.testing.assert_array_equal(saved["ids"], want)
    assert saved["logits"].shape == (3, V)
    assert main([*argv, "--k", "0"]) != 0
    err = capsys.readouterr().err
    assert "k = 0 is outside [1, 1000]" in err and "Traceback" not in err
    assert main(["info", "--target", server.target]) == 0
    assert (
        "head (nearest)     embedding table, k up to 1000, multiplied by numpy"
        in capsys.readouterr().out
    )
