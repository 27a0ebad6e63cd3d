"""The exported graph computes E[id] * scale: exactly in float32, within the stated bound in
float16, at any batch and sequence length, the same for an id wherever it appears."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from tokembed.export import parts
from tokembed.export.errors import ExportError, ParityError
from tokembed.export.model_dir import load_model_dir
from tokembed.export.modules import TokenEmbedding
from tokembed.export.parity import parity_ids, storage_tolerance
from tokembed.export.pipeline import ExportOptions, export_model


def stored_table(model_dir: Path) -> np.ndarray:
    """The 2-D initializer as written to disk (external data included)."""
    model = onnx.load(str(model_dir / "model.onnx"), load_external_data=True)
    tables = [init for init in model.graph.initializer if len(init.dims) == 2]
    assert len(tables) == 1
    array: np.ndarray = numpy_helper.to_array(tables[0])
    return array


def all_ids(vocab_size: int) -> np.ndarray:
    """Every id once, as a [2, V/2]-ish batch (plus 0 again to make V even)."""
    ids = np.arange(vocab_size, dtype=np.int64)
    if ids.size % 2:
        ids = np.append(ids, 0)
    return ids.reshape(2, -1)


# --- parity --------------------------------------------------------------------------


def test_float32_is_exact_for_every_id(small_export, bitwise_equal):
    assert small_export.manifest.parity.max_abs_error == 0.0
    assert small_export.manifest.parity.tolerance == 0.0
    # The export checked every row of a small table, plus 0, V-1 (and padding) again.
    assert small_export.manifest.parity.ids_checked >= small_export.vocab_size
    ids = all_ids(small_export.vocab_size)
    bitwise_equal(small_export.run(ids), small_export.expected(ids))


def test_float32_weights_are_stored_unchanged(small_export, bitwise_equal):
    bitwise_equal(stored_table(small_export.path), small_export.table)
    data = small_export.path / "model.onnx.data"
    assert data.stat().st_size == small_export.vocab_size * small_export.d_model * 4


def test_float16_is_within_the_stated_bound(make_export, bitwise_equal):
    exported = make_export(dtype="float16")
    table, scale = exported.table, exported.scale
    # The bound docs/export.md states: scale * (max|E| * (2^-11 + 2^-22) + 2^-24).
    bound = scale * (float(np.abs(table).max()) * (2**-11 + 2**-22) + 2**-24)
    largest = float(np.abs(table).max())
    assert storage_tolerance("float16", largest, scale) == pytest.approx(bound, rel=1e-12)
    assert exported.manifest.parity.tolerance == pytest.approx(bound, rel=1e-12)

    ids = all_ids(exported.vocab_size)
    got = exported.run(ids)
    assert got.dtype == np.float32
    error = float(np.max(np.abs(got.astype(np.float64) - exported.expected(ids))))
    # Really stored as float16 (so there is an error), and within the bound.
    assert 0.0 < error <= bound
    assert exported.manifest.parity.max_abs_error <= bound
    # Not a loose bound: the worst case is half a float16 ulp of the largest value.
    assert bound < scale * float(np.abs(table).max()) * 2**-10
    # And exactly what the design says: the row rounded to float16, widened, then scaled.
    rounded = table.astype(np.float16).astype(np.float32)
    bitwise_equal(got, rounded[ids] * np.float32(scale))
    assert stored_table(exported.path).dtype == np.float16
    assert (exported.path / "model.onnx.data").stat().st_size == table.size * 2


def test_float16_bound_holds_for_awkward_values(make_export):
    """Values at rounding midpoints, subnormals, the largest float16, tiny and huge mixed."""
    awkward = np.array(
        [
            1 + 2**-11,  # a tie: rounds to even
            1 + 3 * 2**-11,
            2**-25,  # half the smallest float16 subnormal
            3 * 2**-26,
            6.1e-5,  # near the smallest normal float16
            65504.0,  # the largest float16
            -65503.0,
            -1234.567,
            0.0,
            1e-30,
        ],
        dtype=np.float32,
    )
    rng = np.random.default_rng(7)
    table = np.concatenate([awkward, rng.standard_normal(6, dtype=np.float32)]).reshape(4, 4)
    exported = make_export(table=table, dtype="float16", scale=3.0)
    ids = all_ids(4)
    error = float(
        np.max(np.abs(exported.run(ids).astype(np.float64) - table[ids] * np.float32(3.0)))
    )
    assert error <= exported.manifest.parity.tolerance


def test_float16_refuses_a_table_it_cannot_hold(tmp_path):
    table = torch.zeros(4, 3)
    table[2, 1] = 70000.0  # > 65504, would become inf
    module = TokenEmbedding(4, 3, weight=table)
    with pytest.raises(ExportError, match="does not fit float16"):
        export_model(module, ExportOptions(out_dir=tmp_path / "m", weight_dtype="float16"))
    assert not (tmp_path / "m").exists()


def test_parity_failure_fails_the_export_and_leaves_nothing(monkeypatch, tmp_path):
    # A tolerance below zero makes even an exact graph fail: this proves the check is
    # enforced and that a failed export leaves neither the directory nor its staging.
    monkeypatch.setattr(parts, "storage_tolerance", lambda dtype, largest, scale: -1.0)
    module = TokenEmbedding(10, 4, weight=torch.randn(10, 4))
    with pytest.raises(ParityError, match=r"differs from torch by 0 \(tolerance -1"):
        export_model(module, ExportOptions(out_dir=tmp_path / "m"))
    assert list(tmp_path.iterdir()) == []


def test_parity_ids_cover_the_edges():
    ids = parity_ids(1000, 64, padding_idx=17, seed=3)
    assert ids.dtype == np.int64 and ids.ndim == 2 and min(ids.shape) >= 2
    assert {0, 999, 17} <= set(ids.ravel().tolist())
    assert set(ids.ravel().tolist()) == set(range(1000))  # a small table: every row
    big = parity_ids(600_000, 1024, padding_idx=None, seed=3)  # 2.3 GiB: sampled
    assert min(big.shape) >= 2 and {0, 599_999} <= set(big.ravel().tolist())
    assert 16_384 <= big.size < 600_000


# --- shapes ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (64, 512)])
def test_one_export_serves_any_batch_and_length(small_export, bitwise_equal, shape):
    rng = np.random.default_rng(sum(shape))
    ids = rng.integers(0, small_export.vocab_size, size=shape, dtype=np.int64)
    got = small_export.run(ids)
    assert got.shape == (*shape, small_export.d_model)
    bitwise_equal(got, small_export.expected(ids))


def test_graph_declares_batch_and_sequence_dynamic(small_export):
    model = onnx.load(str(small_export.path / "model.onnx"), load_external_data=False)
    (graph_input,) = model.graph.input
    (graph_output,) = model.graph.output
    assert graph_input.name == "input_ids"
    assert graph_output.name == "hidden_states"
    in_dims = graph_input.type.tensor_type.shape.dim
    out_dims = graph_output.type.tensor_type.shape.dim
    assert [d.HasField("dim_param") for d in in_dims] == [True, True]
    assert [d.HasField("dim_param") for d in out_dims[:2]] == [True, True]
    assert out_dims[2].dim_value == small_export.d_model


# --- context-free ----------------------------------------------------------------------


def test_an_id_gives_the_same_vector_at_every_position_and_row(small_export, bitwise_equal):
    rng = np.random.default_rng(11)
    ids = rng.integers(0, 40, size=(6, 50), dtype=np.int64)  # few ids, many repeats
    ids[:, 7] = 5  # one id down a whole column...
    ids[2, :] = 5  # ...and along a whole row
    batch = small_export.run(ids)
    for token in np.unique(ids):
        alone = small_export.run(np.array([[token]], dtype=np.int64))[0, 0]
        where = np.argwhere(ids == token)
        assert len(where) >= 1
        for b, s in where:
            bitwise_equal(batch[b, s], alone)


def test_a_repeated_id_fills_every_row_identically(small_export, bitwise_equal):
    ids = np.full((5, 33), 123, dtype=np.int64)
    out = small_export.run(ids)
    bitwise_equal(out, np.broadcast_to(out[0, 0], out.shape).copy())
    bitwise_equal(out[0, 0], small_export.expected(np.array(123)))


# --- scale and padding -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("scale", "factor"),
    [("sqrt", math.sqrt(48)), ("none", 1.0), (0.125, 0.125), ("3.7", 3.7)],
)
def test_scale(make_export, bitwise_equal, scale, factor):
    exported = make_export(scale=scale)
    assert exported.manifest.scale == factor
    ids = all_ids(exported.vocab_size)
    want = exported.table[ids] * np.float32(factor)
    bitwise_equal(exported.run(ids), want)
    if scale == "none":
        bitwise_equal(exported.run(ids), exported.table[ids])  # no multiply at all
    load_model_dir(exported.path)  # and the loader agrees with the graph's scale


def test_default_scale_is_sqrt_d(make_export):
    exported = make_export(100, 512)
    assert exported.manifest.scale == math.sqrt(512)
    ids = np.array([[1, 2], [3, 4]], dtype=np.int64)
    np.testing.assert_array_equal(
        exported.run(ids), exported.table[ids] * np.float32(np.sqrt(512.0))
    )


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_padding_row_is_zero_and_recorded(make_export, dtype):
    exported = make_export(padding_idx=3, dtype=dtype)
    assert exported.manifest.padding_idx == 3
    ids = np.array([[3, 4, 3], [0, 3, 999]], dtype=np.int64)
    out = exported.run(ids)
    assert not np.any(out[ids == 3])
    assert np.all(np.any(out[ids != 3] != 0, axis=-1))  # the other rows are not zero
    assert not np.any(stored_table(exported.path)[3])
