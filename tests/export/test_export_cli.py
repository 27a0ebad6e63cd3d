"""``tokembed export`` end to end: the issue's "done when", and each flag's effect on the
model directory. Flows that succeed run in-process through the same ``main`` the console
script calls (an export in a fresh process costs seconds of imports)."""

from __future__ import annotations

import json
import math
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from tokembed.cli.main import main
from tokembed.export.model_dir import load_model_dir
from tokembed.export.naming import model_name_for


def export(capsys, out: Path, *flags: object) -> str:
    code = main(["export", "--out", str(out), *(str(f) for f in flags)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return str(captured.out)


def run(model_dir: Path, ids: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(
        str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    out: np.ndarray = session.run(None, {"input_ids": ids})[0]
    return out


def manifest_of(model_dir: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((model_dir / "manifest.json").read_text())  # type: ignore[no-any-return]


def test_done_when_default_export(tmp_path, bitwise_equal):
    """The issue's acceptance check, through the installed console script."""
    script = Path(sysconfig.get_path("scripts")) / "tokembed"
    assert script.is_file(), f"console script missing: {script} (is the project installed?)"
    out = tmp_path / "model"
    proc = subprocess.run(
        [str(script), "export", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr

    # A plain onnxruntime session, nothing of tokembed.
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([[5, 6, 7, 8, 9, 10, 11, 12]], dtype=np.int64)
    (got,) = session.run(["hidden_states"], {"input_ids": ids})
    assert got.shape == (1, 8, 512)

    table = torch.randn(32000, 512, generator=torch.Generator().manual_seed(0))
    want = (table[torch.from_numpy(ids)] * math.sqrt(512)).numpy()
    bitwise_equal(got, want)

    manifest = manifest_of(out)
    assert (manifest["vocab_size"], manifest["d_model"]) == (32000, 512)
    assert manifest["scale"] == math.sqrt(512)
    assert manifest["weight_dtype"] == "float32"
    assert manifest["parity"]["max_abs_error"] == 0.0
    assert manifest["source"] == {"kind": "random", "seed": 0, "init": "normal(0,1)"}
    load_model_dir(out)


def test_seed_and_sizes(tmp_path, capsys, table_of, bitwise_equal):
    out = tmp_path / "model"
    line = export(capsys, out, "--vocab-size", 50, "--d-model", 8, "--seed", 3)
    assert line == (
        f"exported model v1: V=50 D=8 scale=2.82843 weights=float32 max_abs_error=0 -> {out}\n"
    )
    ids = np.arange(50, dtype=np.int64).reshape(5, 10)
    bitwise_equal(run(out, ids), table_of(50, 8, 3)[ids] * np.float32(math.sqrt(8)))
    assert manifest_of(out)["source"]["seed"] == 3
    # Another seed, another table.
    other = tmp_path / "other"
    export(capsys, other, "--vocab-size", 50, "--d-model", 8, "--seed", 4)
    assert not np.array_equal(run(other, ids), run(out, ids))


@pytest.mark.parametrize(("flag", "factor"), [("none", 1.0), ("0.5", 0.5), ("sqrt", math.sqrt(12))])
def test_scale_flag(tmp_path, capsys, table_of, bitwise_equal, flag, factor):
    out = tmp_path / "model"
    export(capsys, out, "--vocab-size", 20, "--d-model", 12, "--scale", flag)
    assert manifest_of(out)["scale"] == factor
    ids = np.arange(20, dtype=np.int64).reshape(4, 5)
    bitwise_equal(run(out, ids), table_of(20, 12, 0)[ids] * np.float32(factor))


def test_padding_flag(tmp_path, capsys, table_of):
    out = tmp_path / "model"
    export(capsys, out, "--vocab-size", 20, "--d-model", 8, "--padding-idx", 0)
    assert manifest_of(out)["padding_idx"] == 0
    ids = np.array([[0, 1], [2, 0]], dtype=np.int64)
    got = run(out, ids)
    assert not np.any(got[0, 0]) and not np.any(got[1, 1])
    # Only the padding row changes: the rest is the same seeded table.
    np.testing.assert_array_equal(got[0, 1], table_of(20, 8, 0)[1] * np.float32(math.sqrt(8)))


def test_dtype_name_and_version_flags(tmp_path, capsys):
    out = tmp_path / "model"
    export(
        capsys, out, "--vocab-size", 20, "--d-model", 8, "--dtype", "float16",
        "--name", "my-embed", "--model-version", "7",
    )  # fmt: skip
    manifest = manifest_of(out)
    assert (manifest["name"], manifest["version"]) == ("my-embed", "7")
    assert manifest["weight_dtype"] == "float16"
    assert manifest["output"]["dtype"] == "float32"
    assert 0 < manifest["parity"]["max_abs_error"] <= manifest["parity"]["tolerance"]
    assert load_model_dir(out).manifest.weight_dtype == "float16"


@pytest.mark.parametrize(
    ("out", "name"),
    [
        ("llama", "llama"),
        ("models/my-model", "my-model"),
        ("repo/llama/3", "llama"),  # a model repository's <model>/<version>
        ("repo/llama/v3", "v3"),  # not all digits: not a version
        ("repo/2024/11", "2024"),
        ("/3", "3"),  # no <model> above the digits: the digits
    ],
)
def test_the_naming_rule(tmp_path, out, name):
    assert model_name_for(tmp_path / out if not out.startswith("/") else Path(out)) == name


def test_an_export_is_named_after_its_directory(tmp_path, capsys):
    for out, name in (("models/my-model", "my-model"), ("repo/llama/3", "llama")):
        line = export(capsys, tmp_path / out, "--vocab-size", 10, "--d-model", 4)
        assert line.startswith(f"exported {name} v1: ")
        assert manifest_of(tmp_path / out)["name"] == name


def test_name_flag_wins_over_the_directory(tmp_path, capsys):
    export(capsys, tmp_path / "repo" / "llama" / "3", "--vocab-size", 10, "--d-model", 4,
           "--name", "chosen")  # fmt: skip
    assert manifest_of(tmp_path / "repo" / "llama" / "3")["name"] == "chosen"


def test_out_dot_is_named_after_the_current_directory(tmp_path, capsys, monkeypatch):
    work = tmp_path / "here-it-is"
    work.mkdir()
    monkeypatch.chdir(work)
    export(capsys, Path("."), "--vocab-size", 10, "--d-model", 4)
    assert manifest_of(work)["name"] == "here-it-is"


def test_manifest_records_what_design_md_names(small_export):
    manifest = manifest_of(small_export.path)
    assert manifest["format"] == "tokembed-model/1"
    assert manifest["input"] == {
        "name": "input_ids",
        "dtype": "int64",
        "shape": ["batch", "sequence"],
    }
    assert manifest["output"] == {
        "name": "hidden_states",
        "dtype": "float32",
        "shape": ["batch", "sequence", small_export.d_model],
    }
    assert manifest["opset"] >= 18
    assert set(manifest["producer"]) >= {"tokembed", "torch", "onnx", "onnxruntime", "python"}
    # sha256 and size of every file in the directory but the manifest itself.
    files = {p.name for p in small_export.path.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == files == {"model.onnx", "model.onnx.data"}
    import hashlib

    for name, entry in manifest["files"].items():
        data = (small_export.path / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "size_bytes": len(data)}


def test_empty_existing_dir_needs_no_force(tmp_path, capsys):
    out = tmp_path / "model"
    out.mkdir()
    export(capsys, out, "--vocab-size", 10, "--d-model", 4)
    load_model_dir(out)


def test_force_replaces_a_previous_export(tmp_path, capsys, table_of, bitwise_equal):
    out = tmp_path / "model"
    export(capsys, out, "--vocab-size", 30, "--d-model", 4, "--seed", 1)
    (out / "notes.txt").write_text("kept")
    export(capsys, out, "--vocab-size", 40, "--d-model", 8, "--seed", 2, "--force")
    model = load_model_dir(out)
    assert (model.manifest.vocab_size, model.manifest.d_model) == (40, 8)
    ids = np.arange(40, dtype=np.int64).reshape(4, 10)
    bitwise_equal(run(out, ids), table_of(40, 8, 2)[ids] * np.float32(math.sqrt(8)))
    # The user's own file stays; no staging directory is left beside the output.
    assert (out / "notes.txt").read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_force_removes_every_file_the_previous_manifest_listed(tmp_path, capsys):
    """A model directory may hold more files than its graph (a tokenizer, a second graph):
    the export that replaces it removes every file the old manifest listed, not only the
    graph's, and keeps the user's own."""
    out = tmp_path / "model"
    export(capsys, out, "--vocab-size", 30, "--d-model", 4)
    raw = manifest_of(out)
    (out / "tokenizer.json").write_text("{}")
    raw["files"]["tokenizer.json"] = {"sha256": "0" * 64, "size_bytes": 2}
    (out / "manifest.json").write_text(json.dumps(raw))
    (out / "notes.txt").write_text("kept")
    export(capsys, out, "--vocab-size", 30, "--d-model", 4, "--force")
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json", "model.onnx", "model.onnx.data", "notes.txt",
    ]  # fmt: skip
    load_model_dir(out)


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as info:
        main(["export", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--out", "--vocab-size", "--d-model", "--seed", "--weights", "--key", "--dtype",
        "--scale", "--padding-idx", "--name", "--model-version", "--force",
    ):  # fmt: skip
        assert flag in text
