"""bfloat16 end to end: models stored in float32, float16 and bfloat16 (made by the real
exporter), served by each backend, asked for answers in float32, float16 and bfloat16
through the real client; every answer bit for bit what torch computes.

What torch computes, for a table stored in dtype W and an answer asked for in dtype A:
in W itself, ``nn.functional.embedding(ids, E_W) * math.sqrt(D)`` (torch multiplies a
float16 or bfloat16 tensor by a Python float in float32 and rounds the product); in any
other dtype, that row widened to float32, scaled, and cast: ``(E_W[ids].float() * s).to(A)``.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from tokembed.client import AsyncEmbeddingClient, EmbeddingClient

from support.models import export_model_dir

# D = 48: sqrt(48) is no power of two, so scaling rounds (a power-of-two scale is exact).
V, D, SEED, PAD = 1000, 48, 5, 3
SCALE = math.sqrt(D)
DTYPES = ("float32", "float16", "bfloat16")
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NUMPY = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
# Each backend, and the table backend without its float16 and bfloat16 tables (those
# answers then cast per answer; a bfloat16 model, which keeps no float32 table, then gets
# the onnxruntime backend).
SETTINGS = {
    "table": {},
    "table-no-cast-tables": {"float16_table_max_bytes": 0, "bfloat16_table_max_bytes": 0},
    "onnxruntime": {"float32_table_max_bytes": 0},
}


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model directories by weight dtype, each exported once for this module."""
    return _Exports(tmp_path_factory)


class _Exports(dict[str, Path]):
    def __init__(self, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self._factory = factory

    def __missing__(self, weight_dtype: str) -> Path:
        """A seeded table stored in ``weight_dtype``, exported by the real exporter."""
        self[weight_dtype] = export_model_dir(
            self._factory.mktemp(f"model-{weight_dtype}") / "model",
            vocab_size=V,
            d_model=D,
            seed=SEED,
            padding_idx=PAD,
            dtype=weight_dtype,
            name=f"m-{weight_dtype}",
        )
        return self[weight_dtype]


@pytest.fixture(params=DTYPES)
def model(request: pytest.FixtureRequest, exports: dict[str, Path]) -> tuple[str, Path]:
    """(weight dtype, model directory), for each weight dtype."""
    return request.param, exports[request.param]


@pytest.fixture
def bfloat16_model(exports: dict[str, Path]) -> Path:
    return exports["bfloat16"]


def torch_answer(weight_dtype: str, answer_dtype: str, ids: np.ndarray) -> np.ndarray:
    """torch's answer (see the module docstring), as the answer dtype's bit patterns."""
    from tokembed.export.modules import random_table

    table = random_table(V, D, SEED, PAD).to(TORCH[weight_dtype])
    with torch.no_grad():
        rows = torch.nn.functional.embedding(torch.from_numpy(ids.astype(np.int64)), table)
        if answer_dtype == weight_dtype:
            answer = rows * SCALE
        else:
            answer = (rows.to(torch.float32) * SCALE).to(TORCH[answer_dtype])
    integer = torch.int16 if answer.element_size() == 2 else torch.int32
    return answer.view(integer).numpy().view(f"u{answer.element_size()}")


def bits(array: np.ndarray) -> np.ndarray:
    return array.view(f"u{array.dtype.itemsize}")


def assert_bits(got: np.ndarray, answer_dtype: str, want: np.ndarray) -> None:
    assert got.dtype == NUMPY[answer_dtype]
    assert got.shape == want.shape
    differ = np.flatnonzero(bits(got) != want)
    assert differ.size == 0, f"{differ.size} values differ from torch's, first at {differ[0]}"


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_every_answer_dtype_from_every_table_is_torchs(
    model: Any, settings: dict[str, int], start_server: Any
) -> None:
    weight_dtype, directory = model
    server = start_server(directory, **settings)
    rng = np.random.default_rng(11)
    # Small answers (sliced rows, on the event loop) and one past the table backend's
    # gather threshold (numpy's gather, off the loop); the padding id among them.
    small = rng.integers(0, V, size=(3, 7))
    small[1, 2] = PAD
    large = rng.integers(0, V, size=(4, 600))
    with EmbeddingClient(server.target) as client:
        info = client.info()
        assert info.weight_dtype == weight_dtype
        assert info.output_dtypes == DTYPES
        for answer_dtype in DTYPES:
            for ids in (small, large):
                hidden = client.embed(ids, answer_dtype)
                assert_bits(hidden, answer_dtype, torch_answer(weight_dtype, answer_dtype, ids))
            # Ragged, padded with the padding id's row in the answer's dtype.
            ragged = [[5, 6, 7], [PAD, 9], [999]]
            hidden = client.embed(ragged, answer_dtype)
            padded = np.array([[5, 6, 7], [PAD, 9, PAD], [999, PAD, PAD]])
            assert_bits(hidden, answer_dtype, torch_answer(weight_dtype, answer_dtype, padded))
    backend = "onnxruntime" if "float32_table_max_bytes" in settings else "table"
    if weight_dtype == "bfloat16" and settings.get("bfloat16_table_max_bytes") == 0:
        backend = "onnxruntime"  # its one table does not fit: no table at all
    assert info.backend == backend


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_a_bfloat16_table_times_the_scale_in_bfloat16_is_torchs_embedding_layer(
    bfloat16_model: Path, settings: dict[str, int], start_server: Any
) -> None:
    """The issue's definition, literally: ``nn.Embedding`` in bfloat16 (the exported
    table's values), then ``* math.sqrt(D)``; every id of the vocabulary."""
    from tokembed.export.modules import random_table

    layer = torch.nn.Embedding(V, D, _weight=random_table(V, D, SEED, PAD).to(torch.bfloat16))
    ids = np.arange(V).reshape(10, -1)
    with torch.no_grad():
        want = (layer(torch.from_numpy(ids)) * math.sqrt(D)).view(torch.int16).numpy()
    server = start_server(bfloat16_model, **settings)
    with EmbeddingClient(server.target) as client:
        hidden = client.embed(ids, "bfloat16")
    assert np.array_equal(bits(hidden), want.view(np.uint16))


def test_bfloat16_answers_are_zero_copy_views_and_travel_every_way(
    model: Any, start_server: Any
) -> None:
    """Unary answers past the decoder's zero-copy size are read-only views of the bytes
    received; the stream's, and the chunked ones (reassembled), hold the same bits."""
    weight_dtype, directory = model
    server = start_server(directory)
    ids = np.random.default_rng(3).integers(0, V, size=(16, 512))  # 786 KiB of bfloat16
    want = torch_answer(weight_dtype, "bfloat16", ids)
    with EmbeddingClient(server.target) as client:
        hidden = client.embed(ids, "bfloat16")
        assert_bits(hidden, "bfloat16", want)
        assert not hidden.flags.writeable and not hidden.flags.owndata
        (streamed,) = client.embed_stream([ids], "bfloat16")
        assert_bits(streamed, "bfloat16", want)
    with EmbeddingClient(server.target, chunked_threshold_bytes=1024) as client:
        client.info()  # the client learns D, and so the answer's size, before it chunks
        chunked = client.embed_result(ids, "bfloat16")
        assert_bits(chunked.hidden_states, "bfloat16", want)
    assert server.metric("tokembed_requests_total", {"method": "EmbedChunked"}) == 1


def test_the_asyncio_client_returns_bfloat16_too(model: Any, start_server: Any) -> None:
    weight_dtype, directory = model
    server = start_server(directory)
    ids = np.array([[1, 2, PAD, 4]])

    async def embed() -> np.ndarray:
        async with AsyncEmbeddingClient(server.target) as client:
            return await client.embed(ids, ml_dtypes.bfloat16)  # by numpy type, as by name

    assert_bits(asyncio.run(embed()), "bfloat16", torch_answer(weight_dtype, "bfloat16", ids))


def test_model_info_of_a_bfloat16_model(bfloat16_model: Path, start_server: Any) -> None:
    data = bfloat16_model / "model.onnx.data"
    assert data.stat().st_size == V * D * 2  # the table is stored in bfloat16
    server = start_server(bfloat16_model)
    with EmbeddingClient(server.target) as client:
        info = client.info()
    assert (info.weight_dtype, info.backend, info.d_model) == ("bfloat16", "table", D)
    assert "bfloat16" in info.output_dtypes
