"""The client's shared-memory session, against the real server with ``--shared-memory
system``: bfloat16 answers and a segment model's token types travel through its region as
they do through V2 itself, bit for bit against the model's reference rows.

(float32 and float16 answers, the session's lifetime and its refusals to open are
tried in tests/e2e/test_v2_shared_memory.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from tokembed.cli.main import main
from tokembed.client import (
    AsyncEmbeddingClient,
    EmbeddingClient,
    InvalidInputError,
    SharedMemoryUnavailableError,
)

from support.fixtures import SMALL_V

SHM_ROOT = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm on this system")

V, D, T, PAD = 500, 16, 3, 1
IDS = np.array([[0, 1, SMALL_V - 1, 17, 5], [999, 3, 0, 2, 400]], dtype=np.int64)


@pytest.fixture
def prefix() -> Iterator[str]:
    """A prefix of this test's own; nothing under it may outlive the test."""
    prefix = f"tokembedc{secrets.token_hex(4)}"
    yield prefix
    left = list(SHM_ROOT.glob(f"{prefix}*"))
    for path in left:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    assert left == [], "a session left its object behind"


@pytest.fixture(scope="module")
def segment_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shm-segment") / "bert"
    assert main(["export", "--out", str(out), "--vocab-size", str(V), "--d-model", str(D),
                 "--padding-idx", str(PAD), "--scale", "sqrt", "--kind", "segment",
                 "--type-vocab-size", str(T)]) == 0  # fmt: skip
    return out


def _tables(model_dir: Path) -> dict[str, np.ndarray]:
    """The graph's tables by name, read from the model's own files."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_dir / "model.onnx"))
    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}


def _torch_bfloat16_bits(rows: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(rows)).to(torch.bfloat16).view(torch.int16).numpy()


def test_bfloat16_answers_through_the_session_are_torch_s(
    start_server: Any, small_model_dir: Path, small_rows: np.ndarray, prefix: str
) -> None:
    server = start_server(small_model_dir, shared_memory="system", shared_memory_prefix=prefix)
    with (
        EmbeddingClient(server.target) as client,
        client.shared_memory(capacity_bytes=1 << 20, prefix=prefix) as session,
    ):
        by_name = session.embed(IDS, "bfloat16")
        assert by_name.dtype == np.dtype(ml_dtypes.bfloat16)
        assert by_name.shape == (*IDS.shape, small_rows.shape[1])
        assert not by_name.flags.writeable
        np.testing.assert_array_equal(by_name.view(np.int16), _torch_bfloat16_bits(small_rows[IDS]))
        kept = by_name.copy()
        # Asked for by numpy type, as the client's embed takes it too; and the same bits
        # as the answer over the socket.
        by_type = session.embed(IDS, ml_dtypes.bfloat16).copy()
        np.testing.assert_array_equal(by_type.view(np.int16), kept.view(np.int16))
        over_socket = client.embed(IDS, "bfloat16")
        np.testing.assert_array_equal(over_socket.view(np.int16), kept.view(np.int16))
        with pytest.raises(InvalidInputError, match="float32, float16 or bfloat16, got 'int8'"):
            session.embed(IDS, "int8")


def test_token_types_through_the_session(start_server: Any, segment_dir: Path, prefix: str) -> None:
    server = start_server(segment_dir, shared_memory="system", shared_memory_prefix=prefix)
    tables = _tables(segment_dir)
    words, kinds, scale = tables["embedding.weight"], tables["segment.weight"], tables["scale"]
    rng = np.random.default_rng(5)
    ids, types = rng.integers(0, V, (3, 7)), rng.integers(0, T, (3, 7))
    want = words[ids] * scale + kinds[types]
    with (
        EmbeddingClient(server.target) as client,
        client.shared_memory(capacity_bytes=1 << 20, prefix=prefix) as session,
    ):
        typed = session.embed(ids, token_types=types).copy()
        np.testing.assert_array_equal(typed, want)
        assert not np.array_equal(typed, words[ids] * scale + kinds[0]), "the types were lost"
        # Each input keeps its own width (INT32 ids beside INT64 types, and the reverse).
        np.testing.assert_array_equal(
            session.embed(ids.astype(np.int32), token_types=types.tolist()), want
        )
        np.testing.assert_array_equal(session.embed(ids, token_types=types.astype(np.int32)), want)
        untyped = session.embed(ids)
        np.testing.assert_array_equal(untyped, words[ids] * scale + kinds[0])
        half = session.embed(ids, "bfloat16", token_types=types)
        np.testing.assert_array_equal(half.view(np.int16), _torch_bfloat16_bits(want))
        # The same answer as the socket's, bit for bit.
        np.testing.assert_array_equal(
            session.embed(ids, token_types=types), client.embed(ids, token_types=types)
        )
        # A type the model does not have is the server's to refuse, naming its range.
        with pytest.raises(InvalidInputError, match=rf"outside its range \[0, {T}\)"):
            session.embed(ids, token_types=np.full_like(types, T))
        # Types that do not match the ids are refused before anything is sent.
        with pytest.raises(InvalidInputError, match="one type per id"):
            session.embed(ids, token_types=types[:, :3])
        np.testing.assert_array_equal(session.embed(ids, token_types=types), want)


def test_inputs_that_do_not_fit_the_region_are_refused_before_sending(
    start_server: Any, segment_dir: Path, prefix: str
) -> None:
    server = start_server(segment_dir, shared_memory="system", shared_memory_prefix=prefix)
    ids = np.zeros((2, 5), dtype=np.int64)  # 80 bytes: the answer would start at 128
    with (
        EmbeddingClient(server.target) as client,
        client.shared_memory(capacity_bytes=128, prefix=prefix) as session,
    ):
        with pytest.raises(InvalidInputError, match=r"the ids \(80 bytes\) do not fit"):
            session.embed(ids)
        with pytest.raises(InvalidInputError, match=r"ids and token types \(96 bytes\)"):
            session.embed(ids[:, :4], token_types=np.zeros((2, 4), dtype=np.int32))
    assert server.metric("tokembed_requests_total", {"protocol": "v2", "method": "ModelInfer"}) == 0


def test_the_asyncio_client_has_the_session_too(
    start_server: Any, small_model_dir: Path, small_rows: np.ndarray, prefix: str
) -> None:
    """The asyncio session is the blocking one's source: the same region, answers and
    contract, awaited; concurrent tasks on one session take turns."""
    server = start_server(small_model_dir, shared_memory="system", shared_memory_prefix=prefix)

    async def main() -> tuple[np.ndarray, list[np.ndarray], str]:
        async with (
            AsyncEmbeddingClient(server.target) as client,
            await client.shared_memory(capacity_bytes=1 << 20, prefix=prefix) as session,
        ):
            assert (SHM_ROOT / session.name).is_file()
            first = await session.embed(IDS)
            kept = first.copy()
            np.testing.assert_array_equal(first, small_rows[IDS])
            assert not first.flags.writeable
            half = await session.embed(IDS[:, :2], "float16")
            np.testing.assert_array_equal(half, small_rows[IDS[:, :2]].astype(np.float16))
            assert not np.array_equal(first, kept), "the next call writes the same bytes"
            copies = await asyncio.gather(
                *(_copied(session.embed(IDS[i : i + 1])) for i in range(len(IDS)))
            )
            return kept, copies, session.name

    kept, copies, name = asyncio.run(asyncio.wait_for(main(), timeout=120))
    np.testing.assert_array_equal(kept, small_rows[IDS])
    for i, copy in enumerate(copies):
        np.testing.assert_array_equal(copy, small_rows[IDS[i : i + 1]])
    assert not (SHM_ROOT / name).exists()


async def _copied(answer: Any) -> np.ndarray:
    return np.array(await answer)


def test_the_asyncio_session_says_why_it_cannot_be_had(
    start_server: Any, small_model_dir: Path, prefix: str
) -> None:
    off = start_server(small_model_dir, shared_memory_prefix=prefix)

    async def main() -> None:
        async with AsyncEmbeddingClient(off.target) as client:
            await client.shared_memory(prefix=prefix)

    with pytest.raises(SharedMemoryUnavailableError, match="shared memory is off"):
        asyncio.run(asyncio.wait_for(main(), timeout=120))
    assert list(SHM_ROOT.glob(f"{prefix}*")) == []


def test_the_client_names_each_dtype_as_the_server_does() -> None:
    """The session names datatypes from the client's table; the server parses them by its
    own: a row that disagreed would be refused, or answer another dtype."""
    from tokembed.client import dtypes as client_dtypes
    from tokembed.server.core import dtypes as server_dtypes

    server = {**server_dtypes.OUTPUT_DTYPES, **server_dtypes.ID_DTYPES}
    assert {row.name: row.v2 for row in client_dtypes.BY_WIRE.values()} == {
        name: row.v2 for name, row in server.items()
    }
