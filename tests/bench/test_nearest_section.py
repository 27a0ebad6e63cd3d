"""The bench's nearest section (``bench/nearest.py``) on a tiny table: its model is
written once and reused, every figure is measured (positive, finite) and the table says
what was measured against what."""

from __future__ import annotations

import math

from tokembed.bench import nearest
from tokembed.export.model_dir import load_model_dir


def test_the_nearest_section_measures_every_figure(tmp_path):
    figures = nearest.run_nearest(
        tmp_path, vocab_size=300, d_model=16, duration_s=0.5, progress=lambda line: None,
        heads=("numpy", "onnxruntime"),
    )  # fmt: skip
    assert [(f.dtype, f.head) for f in figures] == [
        ("float32", "numpy"), ("float32", "onnxruntime"),
        ("bfloat16", "numpy"), ("bfloat16", "onnxruntime"),
    ]  # fmt: skip
    for f in figures:
        assert f.table_bytes == 300 * 16 * (4 if f.dtype == "float32" else 2)
        for value in (f.read_s, f.one_vector_p50_s, f.callers_vectors_per_s,
                      f.in_process_vectors_per_s):  # fmt: skip
            assert 0 < value < math.inf
        # The int8 first pass, once for the float32 table (its ids checked by the section).
        int8 = f.int8_one_vector_p50_s
        once = f.dtype == "float32" and f.head == "numpy"
        assert once == (int8 is not None and 0 < int8 < math.inf)
    model = load_model_dir(tmp_path / "nearest-v300-d16-bfloat16")
    assert model.manifest.head is not None and model.manifest.weight_dtype == "bfloat16"
    table = nearest.markdown(figures, "tokembed bench --nearest")
    assert "`tokembed bench --nearest`" in table
    assert "| bfloat16 | onnxruntime | 300 x 16 |" in table
    assert "int8 first pass one vector p50" in table
