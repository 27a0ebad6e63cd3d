"""Exporting from a checkpoint a slice at a time (``tokembed.export.parts.TokenPart``): the
table written is the checkpoint's matrix widened as ``TokenEmbedding`` widens it and
rounded to the stored dtype as torch rounds it, across the slices' boundaries; the check
compares every slice; what cannot be served as the model computes it is refused; the same
checkpoint gives the same bytes.

Expected values are computed here from the checkpoint's tensors with torch (widen, round
to the stored dtype, multiply by the float32 scale), never with the exporter's helpers.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import save_file

from tokembed.cli.main import main
from tokembed.export.errors import ParityError
from tokembed.export.model_dir import load_model_dir
from tokembed.export.parity import check_in_slices, storage_tolerance

KEY = "embed.weight"
# Past one 32 MiB slice of float32 rows (the writer's) and four 8 MiB ones (the check's),
# with a last slice that is not full.
BIG_V, BIG_D = 70_001, 128


def _save(path: Path, tensor: torch.Tensor) -> Path:
    if path.suffix == ".safetensors":
        save_file({KEY: tensor, "bias": torch.zeros(3)}, str(path))
    else:
        torch.save({KEY: tensor, "bias": torch.zeros(3)}, path)
    return path


class Result(NamedTuple):
    code: int
    out: str
    err: str


def _export(capsys, out: Path, weights: Path, *flags: object) -> Result:
    code = main(["export", "--out", str(out), "--weights", str(weights), "--key", KEY,
                 *(str(f) for f in flags)])  # fmt: skip
    captured = capsys.readouterr()
    return Result(code, captured.out, captured.err)


def _run(model_dir: Path, ids: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(
        str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    out: np.ndarray = session.run(None, {"input_ids": ids})[0]
    return out


def _expected(table: torch.Tensor, stored: str, scale: float) -> np.ndarray:
    rows = table.to(torch.float32)
    if stored != "float32":
        rows = rows.to(getattr(torch, stored)).to(torch.float32)
    result: np.ndarray = (rows * scale).numpy() if scale != 1.0 else rows.numpy()
    return result


@pytest.mark.parametrize("stored", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("source", ["bfloat16", "float16", "float32", "float64"])
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_every_row_as_the_module_computes_it(tmp_path, capsys, bitwise_equal, suffix, source,
                                             stored):  # fmt: skip
    V, D = 300, 48  # sqrt(48) is irrational: the scale really rounds
    table = torch.randn(V, D, generator=torch.Generator().manual_seed(5)).to(getattr(torch, source))
    weights = _save(tmp_path / f"ckpt{suffix}", table)
    result = _export(capsys, tmp_path / "model", weights, "--dtype", stored)
    assert result.code == 0, result.err
    model = load_model_dir(tmp_path / "model")
    assert model.manifest.weight_dtype == stored
    assert model.manifest.parity.ids_checked >= V  # every row, below 256 MiB
    ids = np.arange(V, dtype=np.int64)[::-1].copy().reshape(2, -1)
    bitwise_equal(_run(tmp_path / "model", ids), _expected(table, stored, math.sqrt(D))[ids])


def test_across_slice_boundaries(tmp_path, capsys, bitwise_equal):
    """A table of several slices, the last one short, in float16: every row, in order and
    shuffled, is the checkpoint's row rounded to float16, widened, times sqrt(D)."""
    table = torch.randn(BIG_V, BIG_D, generator=torch.Generator().manual_seed(11))
    weights = _save(tmp_path / "ckpt.safetensors", table)
    result = _export(capsys, tmp_path / "model", weights, "--dtype", "float16")
    assert result.code == 0, result.err
    model = load_model_dir(tmp_path / "model")
    assert (tmp_path / "model" / "model.onnx.data").stat().st_size == BIG_V * BIG_D * 2
    # 0 and V-1, then every row, then V-1 again for an even count.
    assert model.manifest.parity.ids_checked == 2 + BIG_V + 1
    want = _expected(table, "float16", math.sqrt(BIG_D))
    ids = np.arange(BIG_V - 1, dtype=np.int64).reshape(2, -1)  # an even count
    bitwise_equal(_run(tmp_path / "model", ids), want[ids])
    shuffled = np.random.default_rng(0).permutation(BIG_V).astype(np.int64)[:-1].reshape(2, -1)
    bitwise_equal(_run(tmp_path / "model", shuffled), want[shuffled])


def test_a_legacy_torch_file_across_slices(tmp_path, capsys, bitwise_equal):
    """torch's pre-1.6 format cannot be mapped: it is read once, whole, and sliced."""
    table = torch.randn(BIG_V, BIG_D, generator=torch.Generator().manual_seed(12))
    weights = tmp_path / "pytorch_model.bin"
    torch.save({KEY: table}, weights, _use_new_zipfile_serialization=False)
    result = _export(capsys, tmp_path / "model", weights, "--scale", "none")
    assert result.code == 0, result.err
    ids = np.array([[0, 1, BIG_V - 1], [65535, 65536, 4]], dtype=np.int64)
    bitwise_equal(_run(tmp_path / "model", ids), table.numpy()[ids])


def test_the_graph_is_a_gather_a_cast_and_a_mul(tmp_path, capsys):
    table = torch.randn(50, 8, generator=torch.Generator().manual_seed(1))
    weights = _save(tmp_path / "ckpt.safetensors", table)
    shapes = {
        ("float32", "none"): ["Gather"],
        ("float32", "sqrt"): ["Gather", "Mul"],
        ("float16", "none"): ["Gather", "Cast"],
        ("float16", "2.5"): ["Gather", "Cast", "Mul"],
    }
    for (stored, scale), ops in shapes.items():
        out = tmp_path / f"{stored}-{scale}"
        result = _export(capsys, out, weights, "--dtype", stored, "--scale", scale)
        assert result.code == 0, result.err
        graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
        assert [node.op_type for node in graph.node] == ops
        load_model_dir(out)  # the loader reads the scale back from it


def test_the_same_checkpoint_gives_the_same_bytes(tmp_path, capsys):
    """Two exports of one key under two names: identical graph and table, byte for byte
    (what lets a server hold one copy of a table two models share)."""
    table = torch.randn(200, 16, generator=torch.Generator().manual_seed(2))
    weights = _save(tmp_path / "ckpt.safetensors", table)
    for name in ("encoder", "decoder"):
        result = _export(capsys, tmp_path / name, weights, "--dtype", "float16", "--name", name)
        assert result.code == 0, result.err
    for file in ("model.onnx", "model.onnx.data"):
        first, second = ((tmp_path / n / file).read_bytes() for n in ("encoder", "decoder"))
        assert hashlib.sha256(first).digest() == hashlib.sha256(second).digest(), file
    encoder, decoder = (
        json.loads((tmp_path / name / "manifest.json").read_text())
        for name in ("encoder", "decoder")
    )
    assert encoder["files"] == decoder["files"]


@pytest.mark.parametrize(
    ("value", "dtype"),
    [(float("nan"), torch.bfloat16), (float("inf"), torch.float16), (1e300, torch.float64)],
    ids=["nan", "inf", "past-float32"],
)
def test_values_that_are_not_finite_as_float32_are_refused(tmp_path, capsys, value, dtype):
    table = torch.randn(BIG_V // 10, 64, dtype=torch.float64)
    table[-3, 5] = value  # in the last slice
    weights = _save(tmp_path / "ckpt.safetensors", table.to(dtype))
    result = _export(capsys, tmp_path / "model", weights)
    assert result.code == 2
    rows = BIG_V // 10
    assert f"{KEY!r} holds a value that is not finite as float32" in result.err
    assert f"in rows [0, {rows})" in result.err  # 7000 rows of 64: one slice
    assert not (tmp_path / "model").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]


def test_a_table_float16_cannot_hold_names_its_largest_value(tmp_path, capsys):
    table = torch.randn(BIG_V, BIG_D)
    table[10, 0] = 70000.0  # in the first slice ...
    table[-1, -1] = -1e6  # ... and the largest in the last
    weights = _save(tmp_path / "ckpt.safetensors", table)
    result = _export(capsys, tmp_path / "model", weights, "--dtype", "float16")
    assert result.code == 2
    assert "the table's largest magnitude 1e+06 does not fit float16 (max 65504)" in result.err
    assert not (tmp_path / "model").exists()


# --- the check, a slice at a time ---------------------------------------------------------


def _rows(ids: np.ndarray) -> np.ndarray:
    return np.stack([np.full(4, i, dtype=np.float32) for i in ids.reshape(-1)])


def test_check_in_slices_compares_every_slice():
    ids = np.arange(1000, dtype=np.int64).reshape(2, -1)
    seen: list[int] = []

    def run(batch: np.ndarray) -> np.ndarray:
        assert batch.shape[0] == 2  # [2, n]: both dimensions dynamic
        seen.extend(batch.reshape(-1).tolist())
        out = _rows(batch).reshape(2, -1, 4)
        if 997 in batch:
            out[batch == 997] += 0.5  # wrong in the last slice only
        return out

    kwargs = {"tolerance": 0.25, "weight_dtype": "float16", "slice_bytes": 64 * 16, "d_model": 4}
    with pytest.raises(ParityError, match=r"differs from torch by 0\.5 .*over 1000 ids"):
        check_in_slices(run, _rows, ids, **kwargs)
    assert sorted(seen) == list(range(1000))  # 64-id slices, every id run once

    def nan(batch: np.ndarray) -> np.ndarray:
        out = _rows(batch).reshape(2, -1, 4)
        out[batch == 500] = np.nan
        return out

    with pytest.raises(ParityError, match="differs from torch by nan"):
        check_in_slices(nan, _rows, ids, **kwargs)
    answered: list[int] = []

    def answers(piece: np.ndarray, got: np.ndarray) -> None:
        np.testing.assert_array_equal(got, _rows(piece))  # each slice's own answer
        answered.extend(piece.tolist())

    good = check_in_slices(lambda b: _rows(b).reshape(2, -1, 4), _rows, ids, **kwargs,
                           answers=answers)  # fmt: skip
    assert (good.max_abs_error, good.ids_checked) == (0.0, 1000)
    assert sorted(answered) == list(range(1000))


def test_storage_tolerance_is_the_bound_a_module_is_exported_with(tmp_path):
    """The one formula, whether the table comes from a checkpoint or a torch module
    (``export_model``): the manifest records it for each stored dtype."""
    from tokembed.export.modules import TokenEmbedding
    from tokembed.export.pipeline import ExportOptions, export_model

    weight = torch.randn(10, 48) * 3
    module = TokenEmbedding(10, 48, weight=weight)
    largest = float(weight.abs().max())
    for dtype in ("float32", "float16", "bfloat16"):
        options = ExportOptions(out_dir=tmp_path / dtype, weight_dtype=dtype)
        manifest = export_model(module, options)
        assert manifest.parity.tolerance == storage_tolerance(dtype, largest, module.scale)


# --- what reading a memory-mapped torch file leaves resident -------------------------------


def _resident_file_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_a_mapped_torch_file_is_let_go_slice_by_slice(tmp_path):
    """Every page read through torch's mapping stays resident until it is unmapped: the
    matrix lets go of the mapping after each slice it reads, at once (the garbage
    collector is off here: nothing may wait for it, as a reference cycle would)."""
    from tokembed.export.weights import open_matrix

    table = torch.randn(49152, 1024)  # 192 MiB
    path = tmp_path / "model.pt"
    torch.save({"model": {"embed": {"weight": table}}, "other": torch.zeros(4)}, path)
    del table
    chunk = 16 * 1024 * 1024
    gc.disable()
    try:
        before = _resident_file_bytes()
        most = 0
        with open_matrix(path, "model.embed.weight") as matrix:
            for _, rows in matrix.slices(chunk):
                assert rows.shape[1] == 1024
                most = max(most, _resident_file_bytes() - before)
            rows = matrix.take(np.arange(0, 49152, 97, dtype=np.int64))
            after_take = _resident_file_bytes() - before
        after = _resident_file_bytes() - before
    finally:
        gc.enable()
    # A slice's pages, and those mapped around them, at most: far from the 192 MiB.
    assert most < 4 * chunk, most
    # take() reads rows all over the file (how much of it the kernel maps around them
    # depends on the kernel); once the matrix is closed, none of it stays.
    assert after < chunk, (after_take, after)
