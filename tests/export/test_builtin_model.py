"""The built-in default model, built without torch: the same bytes from the same seed
everywhere, a directory the loader accepts like any export, exactly E[id] * sqrt(D), and
safe when two processes build it at once."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from tokembed.export import builtin
from tokembed.export.builtin import DEFAULT, BuiltinSpec, build_builtin_model, seeded_table
from tokembed.export.errors import ExportError, ParityError
from tokembed.export.model_dir import load_model_dir

from support.no_torch import env_without_torch

# sha256 of the default model's model.onnx.data (its table, V x D float32 little-endian).
# If this changes, every served default model changes: that is a breaking change, not a fix.
DEFAULT_TABLE_SHA256 = "59228a6599c2a9997b3dc5482802d5ccac00648dad8b9f909d90edd392b2d92c"
SMALL = BuiltinSpec(vocab_size=300, d_model=24, seed=5, name="small-builtin")


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("builtin") / "default"
    assert build_builtin_model(out) is True
    return out


def _session(model_dir: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])


def test_the_default_table_is_the_same_bytes_from_its_seed(default_dir: Path, tmp_path: Path):
    data = (default_dir / "model.onnx.data").read_bytes()
    assert len(data) == DEFAULT.vocab_size * DEFAULT.d_model * 4
    assert hashlib.sha256(data).hexdigest() == DEFAULT_TABLE_SHA256
    # Two builds are byte-identical, graph included (a small model: the same code path).
    first, second = tmp_path / "first", tmp_path / "second"
    build_builtin_model(first, SMALL)
    build_builtin_model(second, SMALL)
    for name in ("model.onnx", "model.onnx.data"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_the_seed_decides_the_table() -> None:
    np.testing.assert_array_equal(seeded_table(40, 8, 3), seeded_table(40, 8, 3))
    assert not np.array_equal(seeded_table(40, 8, 3), seeded_table(40, 8, 4))
    # Rows are consecutive draws: a smaller table is the start of a larger one's stream.
    np.testing.assert_array_equal(
        seeded_table(40, 8, 3).ravel(), seeded_table(80, 8, 3).ravel()[:320]
    )


def test_the_table_has_mean_0_variance_1_and_no_zero() -> None:
    table = seeded_table(DEFAULT.vocab_size, DEFAULT.d_model, DEFAULT.seed)
    assert table.dtype == np.float32 and table.shape == (32000, 512)
    assert abs(float(table.mean(dtype=np.float64))) < 1e-3
    assert abs(float(table.var(dtype=np.float64)) - 1) < 1e-3
    assert float(np.abs(table).max()) < math.sqrt(3) and np.count_nonzero(table) == table.size


def test_the_loader_accepts_it_and_the_manifest_records_what_an_export_does(default_dir: Path):
    model = load_model_dir(default_dir)
    manifest = model.manifest
    assert (manifest.name, manifest.version) == ("tokembed-default", "1")
    assert (manifest.vocab_size, manifest.d_model, manifest.padding_idx) == (32000, 512, None)
    assert manifest.scale == math.sqrt(512)
    assert manifest.weight_dtype == "float32"
    assert (manifest.input.name, manifest.input.dtype) == ("input_ids", "int64")
    assert manifest.output.shape == ["batch", "sequence", 512]
    assert manifest.opset >= 18
    raw = json.loads((default_dir / "manifest.json").read_text())
    assert raw["format"] == "tokembed-model/1"
    assert set(raw["files"]) == {"model.onnx", "model.onnx.data"}
    for name, entry in raw["files"].items():
        data = (default_dir / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "size_bytes": len(data)}
    # The parity check ran over every row (plus 0 and V-1 again) and found them exact.
    assert raw["parity"] == {"max_abs_error": 0.0, "tolerance": 0.0, "ids_checked": 32002}
    assert raw["source"]["kind"] == "builtin" and raw["source"]["seed"] == 0
    assert raw["source"]["parity_reference"] == "numpy"
    assert {"tokembed", "python", "numpy", "onnx", "onnxruntime"} <= set(raw["producer"])
    assert "torch" not in raw["producer"]


def test_every_row_is_the_definition_times_sqrt_d(
    default_dir: Path, default_rows: np.ndarray
) -> None:
    ids = np.arange(DEFAULT.vocab_size, dtype=np.int64).reshape(4, -1)
    (got,) = _session(default_dir).run(["hidden_states"], {"input_ids": ids})
    want = default_rows[ids]  # computed in the tests from the definition, not the builder
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_graph_that_differs_fails_the_build_and_leaves_nothing(monkeypatch, tmp_path):
    write = builtin.write_table_graph

    def one_ulp_off(table: np.ndarray, scale: float, directory: Path) -> int:
        return write(table, float(np.nextafter(np.float32(scale), np.float32(0))), directory)

    monkeypatch.setattr(builtin, "write_table_graph", one_ulp_off)
    with pytest.raises(ParityError, match="differs from the numpy reference"):
        build_builtin_model(tmp_path / "m", SMALL)
    assert list(tmp_path.iterdir()) == []


def test_an_empty_directory_is_filled_and_a_built_one_left_alone(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    assert build_builtin_model(out, SMALL) is True
    assert load_model_dir(out).manifest.name == "small-builtin"
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert build_builtin_model(out, SMALL) is False
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no staging directory left


def test_a_directory_holding_other_files_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"not empty, but holds no manifest\.json"):
        build_builtin_model(out, SMALL)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("")
    with pytest.raises(ExportError, match="not a directory"):
        build_builtin_model(tmp_path / "file", SMALL)


def test_two_builds_at_once_in_one_directory_both_succeed(monkeypatch, tmp_path):
    """Both builders have staged a complete model before either publishes: one rename wins,
    the other finds the winner's model and uses it."""
    publish = builtin.publish_new
    both_staged = threading.Barrier(2, timeout=60)

    def publish_together(staging: Path, out_dir: Path) -> bool:
        both_staged.wait()
        return publish(staging, out_dir)

    monkeypatch.setattr(builtin, "publish_new", publish_together)
    out = tmp_path / "m"
    results: list[bool] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(build_builtin_model(out, SMALL))
        except BaseException as exc:  # reported below, with the other thread's result
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert sorted(results) == [False, True]
    load_model_dir(out)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


_ENSURE = (
    "import sys; from pathlib import Path; "
    "from tokembed.server.models.default_model import ensure_default_model; "
    "ensure_default_model(Path(sys.argv[1])); "
    "assert 'torch' not in sys.modules"
)


def test_two_processes_without_torch_create_the_default_model_at_once(tmp_path: Path) -> None:
    env = env_without_torch(tmp_path / "no-torch")
    out = tmp_path / "models" / "default"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ENSURE, str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    assert hashlib.sha256((out / "model.onnx.data").read_bytes()).hexdigest() == (
        DEFAULT_TABLE_SHA256
    )
    load_model_dir(out)
    assert [p.name for p in out.parent.iterdir()] == ["default"]


def test_export_builtin_writes_the_server_s_default_model_without_torch(
    default_dir: Path, tmp_path: Path
) -> None:
    """`tokembed export --builtin --out DIR` makes, without torch, the very model that
    `tokembed serve` builds when given none (for images and compose steps to bake in)."""
    out = tmp_path / "models" / "default"
    env = env_without_torch(tmp_path / "no-torch")
    result = subprocess.run(
        [sys.executable, "-m", "tokembed.cli", "export", "--builtin", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    built = json.loads((out / "manifest.json").read_text())
    reference = json.loads((default_dir / "manifest.json").read_text())
    assert built["files"] == reference["files"]  # the same bytes, file by file
    assert built["name"] == "tokembed-default"
    refused = subprocess.run(
        [sys.executable, "-m", "tokembed.cli", "export", "--builtin", "--out", str(tmp_path / "x"),
         "--d-model", "8"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        "tokembed export: error: --builtin takes no --d-model: its model is fixed"
    )
