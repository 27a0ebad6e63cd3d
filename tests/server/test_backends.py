"""The two backends on the small model, loaded as the server loads them: the same bits
for every id in both dtypes, the padding row, batches, and which one a model gets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tokembed.server.backends.base import Backend, LookUp, Rows
from tokembed.server.backends.table import GATHER_MIN_ROWS
from tokembed.server.core.dtypes import FLOAT32, ID_DTYPES, OUTPUT_DTYPES, DType
from tokembed.server.core.types import TokenIds
from tokembed.server.models.loading import LoadedModel, load_model
from tokembed.server.process.settings import Settings

from support.fixtures import SMALL_D, SMALL_PAD, SMALL_V
from support.models import export_model_dir

ONNXRUNTIME = {"float32_table_max_bytes": 0}
FLOAT16 = OUTPUT_DTYPES["float16"]


def look_up(values: np.ndarray, dtype: DType, id_dtype: str = "int64") -> LookUp:
    """The look-up of ``values`` sent as ``id_dtype`` ids, answered in ``dtype``."""
    ids = ID_DTYPES[id_dtype]
    data = np.asarray(values, dtype=ids.numpy).tobytes()
    return LookUp(TokenIds(data, ids, len(values)), dtype)


def joined(rows: Rows) -> bytes:
    return b"".join(rows.pieces(0, len(rows)))


@pytest.fixture(scope="module")
def backends(small_model_dir: Path) -> Iterator[dict[str, Backend]]:
    loaded = {
        "table": load_model(small_model_dir, Settings()),
        "table-no-float16": load_model(small_model_dir, Settings(float16_table_max_bytes=0)),
        "onnxruntime": load_model(small_model_dir, Settings(**ONNXRUNTIME)),
    }
    yield {name: model.backend for name, model in loaded.items()}
    for model in loaded.values():
        model.backend.close()


def test_a_model_that_fits_gets_the_table_and_otherwise_onnxruntime(
    backends: dict[str, Backend],
) -> None:
    assert [backends[name].kind for name in ("table", "table-no-float16", "onnxruntime")] == [
        "table", "table", "onnxruntime",
    ]  # fmt: skip
    assert not backends["table"].batches and backends["onnxruntime"].batches
    assert {b.execution_provider for b in backends.values()} == {"CPUExecutionProvider"}
    assert {b.d_model for b in backends.values()} == {SMALL_D}


@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT16], ids=["float32", "float16"])
def test_every_backend_gives_the_same_bits_for_every_id(
    backends: dict[str, Backend], small_rows: np.ndarray, dtype: DType
) -> None:
    everything = np.arange(SMALL_V)
    ids = np.concatenate([everything, everything[::-1], [SMALL_PAD, 5, 5]])
    want = small_rows[ids].astype(dtype.numpy).tobytes()
    for name, backend in backends.items():
        for id_dtype in ID_DTYPES:
            assert joined(backend.look_up(look_up(ids, dtype, id_dtype))) == want, name


def test_rows_are_cut_anywhere_in_order(
    backends: dict[str, Backend], small_rows: np.ndarray
) -> None:
    ids = np.array([3, 1, 4, 1, 5, 9, 2, 6])
    for name, backend in backends.items():
        rows = backend.look_up(look_up(ids, FLOAT32))
        assert len(rows) == len(ids)
        for start, stop in ((0, 8), (0, 1), (2, 5), (7, 8), (4, 4)):
            got = b"".join(rows.pieces(start, stop))
            assert got == small_rows[ids[start:stop]].tobytes(), (name, start, stop)


def test_the_table_s_rows_are_read_only_views(backends: dict[str, Backend]) -> None:
    rows = backends["table"].look_up(look_up(np.array([7]), FLOAT32))
    (piece,) = rows.pieces(0, 1)
    view = memoryview(piece)
    assert view.readonly and view.nbytes == SMALL_D * 4


@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT16], ids=["float32", "float16"])
def test_a_large_look_up_s_rows_are_views_of_the_table(
    backends: dict[str, Backend], small_rows: np.ndarray, dtype: DType
) -> None:
    """Copied once, by whoever writes the answer: not gathered into an array first."""
    ids = np.random.default_rng(9).integers(0, SMALL_V, GATHER_MIN_ROWS + 3)
    ids[:4] = [5, 6, 7, 5]
    rows = backends["table"].look_up(look_up(ids, dtype))
    pieces = rows.pieces(0, len(rows))
    tables = {id(memoryview(piece).obj) for piece in pieces}
    assert len(tables) == 1 and len(pieces) == len(ids)
    assert memoryview(pieces[0]).obj.nbytes == SMALL_V * SMALL_D * dtype.itemsize
    want = small_rows[ids].astype(dtype.numpy).tobytes()
    assert b"".join(pieces) == want
    assert bytes(rows.joined()) == want  # the least copy (the bench's ceiling)


@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT16], ids=["float32", "float16"])
def test_the_pad_row_is_the_padding_id_s_row(
    backends: dict[str, Backend], small_rows: np.ndarray, dtype: DType
) -> None:
    want = small_rows[SMALL_PAD].astype(dtype.numpy).tobytes()
    for name, backend in backends.items():
        assert backend.pad_row(dtype) == want, name


def test_without_a_padding_id_the_pad_row_is_zeros(tmp_path: Path) -> None:
    directory = export_model_dir(tmp_path / "no-pad", vocab_size=50, d_model=8, seed=3)
    for settings in (Settings(), Settings(**ONNXRUNTIME)):
        backend: Backend = load_model(directory, settings).backend
        assert backend.pad_row(FLOAT32) == bytes(8 * 4)
        assert backend.pad_row(FLOAT16) == bytes(8 * 2)


def test_a_batch_is_one_run_and_each_answer_owns_its_rows(
    backends: dict[str, Backend], small_rows: np.ndarray
) -> None:
    backend = backends["onnxruntime"]
    requests = [np.array([1, 2, 3]), np.array([4]), np.array([5, 6])]
    dtypes = [FLOAT32, FLOAT16, FLOAT32]
    answers = backend.look_up_batch([look_up(i, d) for i, d in zip(requests, dtypes, strict=True)])
    for ids, dtype, rows in zip(requests, dtypes, answers, strict=True):
        assert joined(rows) == small_rows[ids].astype(dtype.numpy).tobytes()
        # Its own memory: not a view of the batch's rows (which a slow reader would keep).
        (piece,) = rows.pieces(0, len(rows))
        array = memoryview(piece).obj
        assert isinstance(array, np.ndarray) and array.nbytes == memoryview(piece).nbytes
        assert not isinstance(array.base, np.ndarray), "a view of the batch's rows"


def test_load_reports_what_it_took(small_model_dir: Path) -> None:
    loaded: LoadedModel = load_model(small_model_dir, Settings())
    assert loaded.model.manifest.name == "small" and loaded.load_s > 0
