"""``tokembed export`` for the segment and factorized kinds, and the model directory's
checks of them: the graphs computed against references written here from the kinds'
definitions (numpy float32 arithmetic, or float64 with the stated bound), the bounds
recorded in the manifest, and the flags' mistakes refused in one line.

(The comparison with Hugging Face's own modules is tests/e2e/test_transformers_kinds.py.)
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch

from tokembed.cli.main import main
from tokembed.export.errors import ModelDirError
from tokembed.export.model_dir import load_model_dir

V, D, T, INNER = 300, 24, 3, 8


def export(capsys: pytest.CaptureFixture[str], out: Path, *flags: object) -> str:
    code = main(["export", "--out", str(out), *(str(f) for f in flags)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def export_error(capsys: pytest.CaptureFixture[str], out: Path, *flags: object) -> str:
    code = main(["export", "--out", str(out), *(str(f) for f in flags)])
    captured = capsys.readouterr()
    assert code != 0
    assert "Traceback" not in captured.err
    return captured.err


def run(model_dir: Path, **inputs: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(
        str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    out: np.ndarray = session.run(None, inputs)[0]
    return out


def manifest_of(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "manifest.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A state_dict with BERT's and ALBERT's keys (torch's zip format)."""
    generator = torch.Generator().manual_seed(7)
    tensors = {
        "bert.word": torch.randn(V, D, generator=generator),
        "bert.types": torch.randn(T, D, generator=generator),
        "albert.word": torch.randn(V, INNER, generator=generator),
        "albert.proj.weight": torch.randn(D, INNER, generator=generator) / math.sqrt(INNER),
        "albert.proj.bias": torch.randn(D, generator=generator),
    }
    path = tmp_path_factory.mktemp("checkpoint") / "model.bin"
    torch.save(tensors, path)
    return path, tensors


@pytest.mark.parametrize("scale", ["none", "sqrt"])
def test_a_segment_export_computes_scaled_word_rows_plus_type_rows_exactly(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    checkpoint: tuple[Path, dict[str, torch.Tensor]],
    scale: str,
) -> None:
    path, tensors = checkpoint
    out = tmp_path / "segment"
    printed = export(capsys, out, "--weights", path, "--key", "bert.word", "--segment-key",
                     "bert.types", "--scale", scale)  # fmt: skip
    assert "(segment)" in printed and f"T={T}" in printed
    manifest = manifest_of(out)
    assert manifest["kind"] == "segment" and manifest["type_vocab_size"] == T
    assert "factor_dim" not in manifest
    factor = np.float32(1.0 if scale == "none" else math.sqrt(D))
    assert manifest["scale"] == float(1.0 if scale == "none" else math.sqrt(D))
    assert manifest["parity"]["tolerance"] == 0.0 and manifest["parity"]["ids_checked"] >= V
    words, types = tensors["bert.word"].numpy(), tensors["bert.types"].numpy()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, V, (4, 50))
    kinds = rng.integers(0, T, (4, 50))
    want = (words[ids] * factor if scale != "none" else words[ids]) + types[kinds]
    got = run(out, input_ids=ids, token_type_ids=kinds)
    assert got.dtype == np.float32 and got.tobytes() == want.astype(np.float32).tobytes()
    assert load_model_dir(out).kind.name == "segment"


def test_a_factorized_export_projects_the_rows_within_its_stated_bound(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    checkpoint: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, tensors = checkpoint
    out = tmp_path / "factorized"
    printed = export(capsys, out, "--weights", path, "--key", "albert.word", "--projection-key",
                     "albert.proj.weight", "--projection-bias-key", "albert.proj.bias")  # fmt: skip
    assert "(factorized)" in printed and f"D'={INNER}" in printed
    manifest = manifest_of(out)
    assert (manifest["kind"], manifest["factor_dim"], manifest["d_model"]) == (
        "factorized", INNER, D,
    )  # fmt: skip
    assert "type_vocab_size" not in manifest
    bound = manifest["parity"]["tolerance"]
    # gamma(D'+1) * (max row norm * max weight-row norm + max bias), twice: recomputed here.
    words = tensors["albert.word"].double().numpy()
    weight = tensors["albert.proj.weight"].double().numpy()
    bias = tensors["albert.proj.bias"].double().numpy()
    unit = 2.0**-24
    gamma = (INNER + 1) * unit / (1 - (INNER + 1) * unit)
    expected = (
        2
        * gamma
        * (
            np.linalg.norm(words, axis=1).max() * (1 + unit) * np.linalg.norm(weight, axis=1).max()
            + np.abs(bias).max()
        )
    )
    assert bound == pytest.approx(expected, rel=1e-9)
    ids = np.arange(V).reshape(3, -1)
    exact = words[ids] @ weight.T + bias
    got = run(out, input_ids=ids)
    assert float(np.abs(got - exact).max()) <= bound / 2  # one side's error: the graph's
    assert manifest["parity"]["max_abs_error"] <= bound


def test_a_factorized_export_without_a_bias_has_no_add(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    checkpoint: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    import onnx

    path, tensors = checkpoint
    out = tmp_path / "nobias"
    export(capsys, out, "--weights", path, "--key", "albert.word", "--projection-key",
           "albert.proj.weight")  # fmt: skip
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    assert [node.op_type for node in graph.node] == ["Gather", "MatMul"]
    ids = np.arange(V).reshape(1, -1)
    exact = (
        tensors["albert.word"].double().numpy()[ids]
        @ tensors["albert.proj.weight"].double().numpy().T
    )
    assert (
        float(np.abs(run(out, input_ids=ids) - exact).max())
        <= manifest_of(out)["parity"]["tolerance"]
    )


@pytest.mark.parametrize("kind", ["segment", "factorized"])
def test_float16_tables_stay_within_the_bound_they_state(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, kind: str
) -> None:
    out = tmp_path / kind
    sizes = ["--type-vocab-size", T] if kind == "segment" else ["--factor-dim", INNER]
    export(capsys, out, "--kind", kind, *sizes, "--vocab-size", V, "--d-model", D,
           "--dtype", "float16", "--scale", "sqrt")  # fmt: skip
    manifest = manifest_of(out)
    assert manifest["weight_dtype"] == "float16"
    parity = manifest["parity"]
    assert 0 < parity["max_abs_error"] <= parity["tolerance"]
    model = load_model_dir(out)
    assert model.kind.name == kind


def test_random_exports_of_each_kind_are_seeded(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for attempt in ("a", "b"):
        export(capsys, tmp_path / attempt, "--kind", "factorized", "--vocab-size", V,
               "--d-model", D, "--seed", 3)  # fmt: skip
    first, second = manifest_of(tmp_path / "a"), manifest_of(tmp_path / "b")
    assert first["files"]["model.onnx.data"] == second["files"]["model.onnx.data"]
    assert first["factor_dim"] == 128 and first["scale"] == 1.0
    assert first["source"] == {"kind": "random", "seed": 3, "init": "normal(0,1)"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--segment-key", "x"], "--segment-key needs --weights"),
        (["--projection-key", "x"], "--projection-key needs --weights"),
        (["--projection-bias-key", "x"], "--projection-bias-key needs --projection-key"),
        (["--type-vocab-size", "2"], "--type-vocab-size is for --kind segment"),
        (["--kind", "segment", "--factor-dim", "4"], "--factor-dim is for --kind factorized"),
        (["--kind", "segment", "--type-vocab-size", "0"], "--type-vocab-size must be positive"),
        (
            ["--kind", "segment", "--type-vocab-size", "2", "--vocab-size", "10", "--d-model", "4"],
            None,
        ),
    ],
)
def test_flags_that_do_not_go_together_are_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], message: str | None
) -> None:
    if message is None:  # a valid command: proves the list above is not refused wholesale
        export(capsys, tmp_path / "ok", *flags)
        return
    assert message in export_error(capsys, tmp_path / "model", *flags)


def test_the_builtin_model_takes_no_kind_flags(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    error = export_error(capsys, tmp_path / "m", "--builtin", "--kind", "segment")
    assert "--builtin takes no --kind" in error


def test_checkpoint_flags_that_do_not_go_together_are_refused(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    checkpoint: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, _ = checkpoint
    base = ["--weights", path, "--key", "bert.word"]
    both = [*base, "--segment-key", "bert.types", "--projection-key", "albert.proj.weight"]
    assert "make different kinds" in export_error(capsys, tmp_path / "m", *both)
    assert "--kind is for random models" in export_error(
        capsys, tmp_path / "m", *base, "--kind", "segment"
    )
    # A segment table whose width is not the word table's.
    wrong = [*base, "--segment-key", "albert.word"]
    assert "both need D=24 columns" in export_error(capsys, tmp_path / "m", *wrong)
    missing = [*base, "--segment-key", "bert.nope"]
    assert "'bert.nope' not found" in export_error(capsys, tmp_path / "m", *missing)
    bias = ["--weights", path, "--key", "albert.word", "--projection-key", "albert.proj.weight",
            "--projection-bias-key", "bert.word"]  # fmt: skip
    assert "expected a 1-D float vector" in export_error(capsys, tmp_path / "m", *bias)


# --- the model directory's checks of a kind's manifest and graph


@pytest.fixture(scope="module")
def segment_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("segment") / "model"
    assert main(["export", "--out", str(out), "--kind", "segment", "--vocab-size", str(V),
                 "--d-model", str(D), "--type-vocab-size", str(T)]) == 0  # fmt: skip
    return out


def _with_manifest(source: Path, target: Path, **changes: Any) -> Path:
    shutil.copytree(source, target)
    manifest = manifest_of(target)
    for key, value in changes.items():
        if value is None:
            manifest.pop(key, None)
        else:
            manifest[key] = value
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"type_vocab_size": None}, "a segment model needs field 'type_vocab_size'"),
        ({"type_vocab_size": 0}, "type_vocab_size must be positive, got 0"),
        ({"factor_dim": 8}, "field 'factor_dim' is not one a segment model has"),
        ({"type_vocab_size": T + 1}, f"segment [{T + 1}, {D}]"),
        ({"kind": "token", "type_vocab_size": None}, "takes ['input_ids']"),
        ({"kind": "sparse"}, "kind 'sparse' is not one this tokembed knows"),
    ],
)
def test_a_segment_manifest_that_disagrees_is_refused_naming_the_field(
    segment_dir: Path, tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    broken = _with_manifest(segment_dir, tmp_path / "broken", **changes)
    with pytest.raises(ModelDirError) as error:
        load_model_dir(broken)
    assert message in str(error.value)


def test_a_token_manifest_has_no_kind_sizes(small_model_dir: Path) -> None:
    """A token model's manifest is what it was before kinds had sizes: no nulls."""
    manifest = manifest_of(small_model_dir)
    assert "type_vocab_size" not in manifest and "factor_dim" not in manifest
    assert load_model_dir(small_model_dir).manifest.type_vocab_size is None
