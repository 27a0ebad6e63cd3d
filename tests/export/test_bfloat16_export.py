"""``tokembed export --dtype bfloat16``: the table stored in bfloat16 (V x D x 2 bytes),
the graph gathering bfloat16 rows, widening them exactly and scaling in float32; a
bfloat16 checkpoint kept bit for bit; the export's parity check over every answer dtype,
and what it refuses."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import save_file

from tokembed.export.errors import ExportError, ParityError
from tokembed.export.manifest import Manifest
from tokembed.export.modules import TokenEmbedding
from tokembed.export.pipeline import ExportOptions, export_model


def seeded_table(vocab_size: int, d_model: int, seed: int) -> np.ndarray:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(vocab_size, d_model, generator=generator, dtype=torch.float32).numpy()


def stored_bits(model_dir: Path) -> np.ndarray:
    """The table's raw 16-bit patterns, read from the external data file."""
    return np.fromfile(model_dir / "model.onnx.data", dtype="<u2")


def torch_bits(values: torch.Tensor) -> np.ndarray:
    return values.contiguous().view(torch.int16).numpy().view(np.uint16)


def test_the_table_is_stored_in_bfloat16_and_the_graph_widens_then_scales(
    make_export: Callable[..., Any],
) -> None:
    exported = make_export(dtype="bfloat16", padding_idx=3)  # V=1000, D=48
    vocab_size, d_model = exported.vocab_size, exported.d_model
    table = torch.from_numpy(exported.table).to(torch.bfloat16)  # rounds to nearest even
    assert (exported.path / "model.onnx.data").stat().st_size == vocab_size * d_model * 2
    assert np.array_equal(stored_bits(exported.path), torch_bits(table).reshape(-1))
    graph = onnx.load(str(exported.path / "model.onnx"), load_external_data=False).graph
    (weight,) = [init for init in graph.initializer if len(init.dims) == 2]
    assert weight.data_type == onnx.TensorProto.BFLOAT16
    assert [node.op_type for node in graph.node] == ["Gather", "Cast", "Mul"]
    assert exported.manifest.weight_dtype == "bfloat16"
    # float32 answers: each bfloat16 row widened exactly, times float32(sqrt(D)).
    ids = np.arange(vocab_size).reshape(2, -1)
    want = table.to(torch.float32).numpy()[ids] * np.float32(math.sqrt(d_model))
    assert np.array_equal(exported.run(ids).view(np.uint32), want.view(np.uint32))
    # Against the float32 table it came from: within the stated bound, which is not 0.
    parity = exported.manifest.parity
    assert 0 < parity.max_abs_error <= parity.tolerance
    largest = float(np.abs(exported.table).max())
    assert parity.tolerance == math.sqrt(d_model) * (largest * (2**-8 + 2**-22) + 2**-133)
    assert parity.ids_checked >= vocab_size


def test_a_bfloat16_checkpoint_is_exported_bit_for_bit(
    tmp_path: Path, tokembed_main: Callable[..., Any]
) -> None:
    """A Llama-style checkpoint holds its embedding in bfloat16: exported as bfloat16,
    its values are kept exactly (the loader widens them to float32, which is exact,
    and the export narrows them back)."""
    weight = torch.from_numpy(seeded_table(300, 40, 9) * 1e3).to(torch.bfloat16)
    weight[0, :4] = torch.tensor([1e-40, -3e38, 2**-133, 0.0])  # subnormal, near the top
    checkpoint = tmp_path / "model.safetensors"
    save_file({"model.embed_tokens.weight": weight, "lm_head.weight": weight.clone()}, checkpoint)
    out = tmp_path / "llama"
    done = tokembed_main(
        "export", "--weights", checkpoint, "--key", "model.embed_tokens.weight",
        "--dtype", "bfloat16", "--scale", "none", "--out", out,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "weights=bfloat16" in done.stdout
    assert np.array_equal(stored_bits(out), torch_bits(weight).reshape(-1))
    manifest = Manifest.read(out)
    # Exact against the checkpoint: its values are bfloat16 already.
    assert (manifest.weight_dtype, manifest.parity.max_abs_error) == ("bfloat16", 0.0)


def test_the_parity_check_refuses_answers_that_are_not_torchs_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph whose float32 answers stay within the table's rounding of the float32
    module (2**-8 of the largest value) but are not the stored table's answers bit for
    bit is refused: here onnxruntime's answers are nudged by 2**-10 of each value."""
    run = ort.InferenceSession.run

    def nudged(self: ort.InferenceSession, *args: Any, **kwargs: Any) -> Any:
        outputs = run(self, *args, **kwargs)
        return [output * np.float32(1 + 2**-10) for output in outputs]

    monkeypatch.setattr(ort.InferenceSession, "run", nudged)
    table = torch.from_numpy(seeded_table(200, 16, 4))
    module = TokenEmbedding(200, 16, weight=table)
    options = ExportOptions(out_dir=tmp_path / "m", weight_dtype="bfloat16")
    with pytest.raises(ParityError, match=r"float32 answers differ from torch's \(the stored"):
        export_model(module, options)
    assert not (tmp_path / "m").exists()  # nothing is left where a server could find it


def test_a_table_past_bfloat16s_range_is_refused(tmp_path: Path) -> None:
    table = torch.zeros(4, 3)
    table[1, 2] = 3.4e38  # float32, but past bfloat16's largest (3.3895e38): infinity
    module = TokenEmbedding(4, 3, weight=table, scale="none")
    with pytest.raises(ExportError, match="does not fit bfloat16"):
        export_model(module, ExportOptions(out_dir=tmp_path / "m", weight_dtype="bfloat16"))
