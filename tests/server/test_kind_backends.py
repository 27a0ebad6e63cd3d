"""The segment and factorized kinds' backends, loaded as the server loads them: the table
(a segment model's row per (id, type); a factorized model's projected rows) against
onnxruntime per batch, small and large look-ups, batches against look-ups alone, the
padding row, and which way each model is served with what memory.

The references are computed here from the kinds' definitions: ``E[id] * scale + S[t]``
in float32 numpy (exact), ``(E[id] * scale) @ P + b`` in float64 (within the manifest's
bound).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokembed.cli.main import main
from tokembed.export.kinds import TOKEN_TYPE_IDS
from tokembed.server.backends.base import Backend, LookUp, Rows
from tokembed.server.backends.table import GATHER_MIN_ROWS
from tokembed.server.core.dtypes import FLOAT32, INT64, OUTPUT_DTYPES
from tokembed.server.core.types import TokenIds
from tokembed.server.models.loading import load_model
from tokembed.server.process.settings import Settings

V, D, T, INNER, PAD = 500, 16, 3, 8, 1
FLOAT16 = OUTPUT_DTYPES["float16"]
ONNXRUNTIME = {"float32_table_max_bytes": 0}


def _export(out: Path, *flags: str) -> Path:
    assert main(["export", "--out", str(out), "--vocab-size", str(V), "--d-model", str(D),
                 "--padding-idx", str(PAD), "--scale", "sqrt", *flags]) == 0  # fmt: skip
    return out


def _tables(model_dir: Path) -> dict[str, np.ndarray]:
    """The graph's tables by name, read from the model's own files."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_dir / "model.onnx"))
    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}


def _look_up(ids: np.ndarray, types: np.ndarray | None, dtype: Any = FLOAT32) -> LookUp:
    more = None
    if types is not None:
        more = {TOKEN_TYPE_IDS: TokenIds(types.astype("<i8").tobytes(), INT64, types.size)}
    return LookUp(TokenIds(ids.astype("<i8").tobytes(), INT64, ids.size), dtype, more)


def _rows(rows: Rows, dtype: Any = FLOAT32) -> np.ndarray:
    data = b"".join(bytes(piece) for piece in rows.pieces(0, len(rows)))
    return np.frombuffer(data, dtype=dtype.numpy).reshape(len(rows), -1)


@pytest.fixture(scope="module")
def segment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    model_dir = _export(tmp_path_factory.mktemp("segment") / "model", "--kind", "segment",
                        "--type-vocab-size", str(T))  # fmt: skip
    tables = _tables(model_dir)
    loaded = {
        "table": load_model(model_dir, Settings()),
        "onnxruntime": load_model(model_dir, Settings(**ONNXRUNTIME)),
    }
    yield {"tables": tables, "backends": {name: m.backend for name, m in loaded.items()}}
    for model in loaded.values():
        model.backend.close()


@pytest.fixture(scope="module")
def factorized(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    model_dir = _export(tmp_path_factory.mktemp("factorized") / "model", "--kind",
                        "factorized", "--factor-dim", str(INNER))  # fmt: skip
    loaded = {
        "table": load_model(model_dir, Settings()),
        "onnxruntime": load_model(model_dir, Settings(**ONNXRUNTIME)),
    }
    yield {
        "tables": _tables(model_dir),
        "bound": loaded["table"].model.manifest.parity.tolerance,
        "backends": {name: m.backend for name, m in loaded.items()},
    }
    for model in loaded.values():
        model.backend.close()


def _segment_reference(tables: dict[str, np.ndarray], ids: np.ndarray, types: np.ndarray) -> Any:
    words, kinds = tables["embedding.weight"], tables["segment.weight"]
    scale = tables["scale"]
    assert scale.dtype == np.float32
    return words[ids] * scale + kinds[types]


@pytest.mark.parametrize("count", [7, GATHER_MIN_ROWS + 3], ids=["small", "large"])
@pytest.mark.parametrize("backend", ["table", "onnxruntime"])
def test_segment_rows_are_the_scaled_word_rows_plus_the_type_rows(
    segment: dict[str, Any], backend: str, count: int
) -> None:
    rng = np.random.default_rng(count)
    ids, types = rng.integers(0, V, count), rng.integers(0, T, count)
    ids[:2], types[:2] = [V - 1, 0], [T - 1, 0]
    want = _segment_reference(segment["tables"], ids, types)
    served = segment["backends"][backend]
    got = _rows(served.look_up(_look_up(ids, types)))
    assert got.tobytes() == want.tobytes()
    half = _rows(served.look_up(_look_up(ids, types, FLOAT16)), FLOAT16)
    assert half.tobytes() == want.astype(np.float16).tobytes()


def test_segment_batches_give_each_request_what_it_gets_alone(segment: dict[str, Any]) -> None:
    served: Backend = segment["backends"]["onnxruntime"]
    rng = np.random.default_rng(5)
    requests = [
        _look_up(rng.integers(0, V, n), rng.integers(0, T, n), dtype)
        for n, dtype in ((3, FLOAT32), (40, FLOAT16), (9, FLOAT32))
    ]
    together = served.look_up_batch(requests)
    for request, rows in zip(requests, together, strict=True):
        assert (
            _rows(rows, request.dtype).tobytes()
            == _rows(served.look_up(request), request.dtype).tobytes()
        )


def test_a_batch_mixing_requests_with_and_without_types_gives_each_its_own_rows(
    segment: dict[str, Any],
) -> None:
    # Validation leaves types out when a request sends none: the batch fills them with 0s
    # for that request alone.
    served: Backend = segment["backends"]["onnxruntime"]
    rng = np.random.default_rng(6)
    with_types = (rng.integers(0, V, 5), rng.integers(1, T, 5))
    without = rng.integers(0, V, 4)
    together = served.look_up_batch([_look_up(*with_types), _look_up(without, None)])
    assert (
        _rows(together[0]).tobytes() == _segment_reference(segment["tables"], *with_types).tobytes()
    )
    assert (
        _rows(together[1]).tobytes()
        == _segment_reference(segment["tables"], without, np.zeros_like(without)).tobytes()
    )


def test_a_segment_look_up_without_types_is_type_zero(segment: dict[str, Any]) -> None:
    ids = np.array([0, 5, V - 1, PAD])
    want = _segment_reference(segment["tables"], ids, np.zeros_like(ids))
    for served in segment["backends"].values():
        assert _rows(served.look_up(_look_up(ids, None))).tobytes() == want.tobytes()


def test_segment_padding_rows_are_the_padding_id_with_type_zero(segment: dict[str, Any]) -> None:
    want = _segment_reference(segment["tables"], np.array([PAD]), np.array([0]))
    for served in segment["backends"].values():
        assert served.pad_row(FLOAT32) == want.tobytes()
        assert served.pad_row(FLOAT16) == want.astype(np.float16).tobytes()


def test_segment_memory_and_the_ways_of_serving_it(segment: dict[str, Any]) -> None:
    table, runtime = segment["backends"]["table"], segment["backends"]["onnxruntime"]
    assert (table.kind, runtime.kind) == ("table", "onnxruntime")
    # The float32 rows, and their float16 and bfloat16 casts (the default budgets), mapped
    # from the table cache (on by default).
    cells = T * V * D
    want = {"mapped float32 table": cells * 4, "mapped float16 table": cells * 2,
            "mapped bfloat16 table": cells * 2}  # fmt: skip
    assert table.memory_bytes == want
    weights = (V + T) * D * 4
    assert runtime.memory_bytes["weights"] >= weights
    assert table.serving_memory == runtime.serving_memory
    assert table.serving_memory["table"] == cells * 8


@pytest.mark.parametrize("count", [7, GATHER_MIN_ROWS + 3], ids=["small", "large"])
@pytest.mark.parametrize("backend", ["table", "onnxruntime"])
def test_factorized_rows_are_the_projection_of_the_scaled_rows_within_the_bound(
    factorized: dict[str, Any], backend: str, count: int
) -> None:
    tables = factorized["tables"]
    rng = np.random.default_rng(count)
    ids = rng.integers(0, V, count)
    scaled = tables["embedding.weight"][ids].astype(np.float64) * float(tables["scale"])
    want = scaled @ tables["projection.weight"].astype(np.float64) + tables["bias"]
    got = _rows(factorized["backends"][backend].look_up(_look_up(ids, None)))
    assert got.shape == (count, D)
    assert float(np.abs(got - want).max()) <= factorized["bound"] / 2


def test_factorized_batches_stay_within_the_bound_of_each_request_alone(
    factorized: dict[str, Any],
) -> None:
    """A matmul's rows may round differently in batches of other sizes (the library picks
    its kernel by shape): each is within the stated bound of the reference, so two runs
    are within the bound of each other."""
    served: Backend = factorized["backends"]["onnxruntime"]
    assert served.batches
    rng = np.random.default_rng(6)
    requests = [_look_up(rng.integers(0, V, n), None) for n in (1, 64, 700)]
    together = served.look_up_batch(requests)
    for request, rows in zip(requests, together, strict=True):
        alone = _rows(served.look_up(request))
        assert float(np.abs(_rows(rows) - alone).max()) <= factorized["bound"]


def test_a_factorized_model_s_two_ways_and_their_memory(factorized: dict[str, Any]) -> None:
    table, runtime = factorized["backends"]["table"], factorized["backends"]["onnxruntime"]
    assert table.memory_bytes["mapped float32 table"] == V * D * 4
    assert runtime.batches and not table.batches
    # The per-batch way holds the [V, D'] table, not [V, D].
    assert runtime.memory_bytes["weights"] < V * D * 4
    assert runtime.serving_memory["onnxruntime"] == sum(runtime.memory_bytes.values())
