"""Which row tables the table backend keeps (``Settings.tables``, the one place it is
decided), and that a bfloat16 model, loaded as the server loads it, holds its bfloat16
table alone: no float32 table doubling its memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokembed.server.models.loading import load_model
from tokembed.server.process.settings import MiB, Settings

from support.models import export_model_dir

V, D = 300, 40


@pytest.fixture(scope="module")
def bfloat16_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_model_dir(
        tmp_path_factory.mktemp("bf16") / "model", vocab_size=V, d_model=D, seed=2,
        padding_idx=1, dtype="bfloat16", name="bf16",
    )  # fmt: skip


def test_a_float32_or_float16_model_keeps_every_table_that_fits() -> None:
    for weights in ("float32", "float16"):
        assert Settings().tables(V, D, weights) == {
            "float32": V * D * 4, "float16": V * D * 2, "bfloat16": V * D * 2,
        }  # fmt: skip
        narrow = Settings(float16_table_max_bytes=V * D * 2 - 1)
        assert narrow.tables(V, D, weights) == {"float32": V * D * 4, "bfloat16": V * D * 2}
        assert Settings(float32_table_max_bytes=V * D * 4 - 1).tables(V, D, weights) == {}


def test_a_bfloat16_model_keeps_its_bfloat16_table_alone() -> None:
    assert Settings().tables(V, D, "bfloat16") == {"bfloat16": V * D * 2}
    # Its table's budget decides, not float32's (a float32 table is never kept) ...
    assert Settings(float32_table_max_bytes=1).tables(V, D, "bfloat16") == {"bfloat16": V * D * 2}
    assert Settings(bfloat16_table_max_bytes=V * D * 2 - 1).tables(V, D, "bfloat16") == {}
    # ... but 0 means never a table, for every model.
    assert Settings(float32_table_max_bytes=0).tables(V, D, "bfloat16") == {}
    # A Llama-3-sized table (1 GiB in bfloat16) is past the default 512 MiB: onnxruntime.
    assert Settings().tables(128256, 4096, "bfloat16") == {}
    assert Settings(bfloat16_table_max_bytes=1024 * MiB).tables(128256, 4096, "bfloat16") == {
        "bfloat16": 128256 * 4096 * 2
    }


def test_the_loaded_bfloat16_model_holds_one_bfloat16_table(bfloat16_model_dir: Path) -> None:
    backend = load_model(bfloat16_model_dir, Settings()).backend
    assert backend.kind == "table"
    weights = (bfloat16_model_dir / "model.onnx.data").stat().st_size
    assert weights == V * D * 2
    held = backend.memory_bytes
    assert held["mapped bfloat16 table"] == V * D * 2  # from the table cache (the default)
    assert not {"float32 table", "float16 table", "mapped float32 table",
                "mapped float16 table"} & set(held)  # fmt: skip
    # The model, run for float32 and float16 answers, maps its files (model.onnx and its
    # data) rather than holding a copy.
    files = sum(p.stat().st_size for p in bfloat16_model_dir.glob("model.onnx*"))
    assert held["weights mapped by onnxruntime"] == files
    backend.close()


def test_without_room_for_its_table_a_bfloat16_model_runs_per_batch(
    bfloat16_model_dir: Path,
) -> None:
    backend = load_model(bfloat16_model_dir, Settings(bfloat16_table_max_bytes=0)).backend
    assert backend.kind == "onnxruntime"
    backend.close()
