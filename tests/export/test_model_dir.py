"""The model-directory loader trusts nothing: it finds damaged, swapped, truncated and
missing files, and a manifest that disagrees with the graph, and says exactly where."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tokembed.export.errors import ModelDirError
from tokembed.export.model_dir import load_model_dir


def edit_manifest(model_dir: Path, change: Any) -> None:
    path = model_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def rehash(model_dir: Path, name: str) -> None:
    """Make the manifest agree with a file again, so a deeper check is what fails."""
    data = (model_dir / name).read_bytes()

    def change(manifest: dict[str, Any]) -> None:
        manifest["files"][name] = {
            "sha256": hashlib.sha256(data).hexdigest(),
            "size_bytes": len(data),
        }

    edit_manifest(model_dir, change)


def load_error(model_dir: Path, **kwargs: Any) -> str:
    with pytest.raises(ModelDirError) as info:
        load_model_dir(model_dir, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_good_directory_loads(small_export):
    model = load_model_dir(small_export.path)
    assert model.manifest == small_export.manifest
    assert model.model_path == small_export.path / "model.onnx"
    assert model.weight_bytes == sum(p.stat().st_size for p in model.path.glob("model.onnx*"))
    assert model.model_sha256 == hashlib.sha256(model.model_path.read_bytes()).hexdigest()
    # Directories of every flavour the exporter writes load too.
    load_model_dir(str(small_export.path))


@pytest.mark.parametrize("offset", [0, 12345, -1])
def test_corrupted_byte_in_weights(model_copy, offset):
    data = model_copy / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[offset] ^= 0x01  # one bit: same size, different content
    data.write_bytes(bytes(raw))
    message = load_error(model_copy)
    assert str(data) in message and "sha256" in message


def test_corrupted_byte_in_graph(model_copy):
    graph = model_copy / "model.onnx"
    raw = bytearray(graph.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    graph.write_bytes(bytes(raw))
    message = load_error(model_copy)
    assert str(graph) in message and "sha256" in message


def test_swapped_weights_from_another_export(model_copy, make_export):
    other = make_export(seed=1)  # same V and D: a data file of the very same size
    source = other.path / "model.onnx.data"
    target = model_copy / "model.onnx.data"
    assert source.stat().st_size == target.stat().st_size
    shutil.copyfile(source, target)
    message = load_error(model_copy)
    assert str(target) in message and "sha256" in message


def test_swapped_graph_from_another_export(model_copy, make_export):
    other = make_export(scale="none")  # a graph without the multiply
    shutil.copyfile(other.path / "model.onnx", model_copy / "model.onnx")
    assert str(model_copy / "model.onnx") in load_error(model_copy)  # size or sha256
    # Even with the hashes made to match, the graph betrays it: it has no scale.
    rehash(model_copy, "model.onnx")
    message = load_error(model_copy)
    assert "model.onnx" in message and "scale" in message


def test_truncated_graph(model_copy):
    graph = model_copy / "model.onnx"
    raw = graph.read_bytes()
    graph.write_bytes(raw[: len(raw) // 2])
    message = load_error(model_copy)
    assert str(graph) in message and f"the manifest records {len(raw)}" in message
    # With size and hash made to match, the parse itself fails, naming the file.
    rehash(model_copy, "model.onnx")
    message = load_error(model_copy)
    assert message.startswith(f"{graph}: not a readable ONNX model")


def test_truncated_weights(model_copy):
    data = model_copy / "model.onnx.data"
    with data.open("r+b") as handle:
        handle.truncate(data.stat().st_size - 4)
    message = load_error(model_copy, verify_hashes=False)
    assert str(data) in message and "size is" in message


@pytest.mark.parametrize("name", ["model.onnx", "model.onnx.data"])
def test_missing_file(model_copy, name):
    (model_copy / name).unlink()
    assert load_error(model_copy) == f"{model_copy / name}: listed in the manifest but missing"


def test_missing_manifest(model_copy):
    (model_copy / "manifest.json").unlink()
    assert load_error(model_copy) == f"{model_copy / 'manifest.json'}: manifest missing"


def test_missing_directory(tmp_path):
    assert load_error(tmp_path / "nope") == f"{tmp_path / 'nope'}: model directory does not exist"


def test_weights_file_not_listed(model_copy):
    edit_manifest(model_copy, lambda m: m["files"].pop("model.onnx.data"))
    message = load_error(model_copy)
    assert "'model.onnx.data'" in message and "does not list" in message


def test_file_outside_the_directory(model_copy):
    def change(m: dict[str, Any]) -> None:
        m["files"]["../secret"] = {"sha256": "0" * 64, "size_bytes": 1}

    edit_manifest(model_copy, change)
    assert "'../secret' points outside the model directory" in load_error(model_copy)


# A manifest that disagrees with the graph: the message names the graph file and the field.
DISAGREEMENTS = {
    "d_model": (lambda m: m.update(d_model=65), "d_model"),
    "d_model and output shape": (
        lambda m: (m.update(d_model=65), m["output"]["shape"].__setitem__(2, 65)),
        "d_model",
    ),
    "vocab_size": (lambda m: m.update(vocab_size=1001), "[vocab_size, d_model] is [1001, 48]"),
    # What the graph takes, and what the manifest's kind and input.name say it should.
    "input name": (
        lambda m: m["input"].update(name="ids"),
        ("graph inputs are ['input_ids']", "a token model with", "input.name 'ids' takes ['ids']"),
    ),
    "output name": (lambda m: m["output"].update(name="embeddings"), "output.name"),
    "input dtype": (lambda m: m["input"].update(dtype="int32"), "input.dtype is int32"),
    "output dtype": (lambda m: m["output"].update(dtype="float16"), "output.dtype is float16"),
    "weight_dtype": (lambda m: m.update(weight_dtype="float16"), "weight_dtype is float16"),
    "opset": (lambda m: m.update(opset=7), "opset is 7"),
    "scale": (lambda m: m.update(scale=1.0), "scale is 1.0"),
}


@pytest.mark.parametrize("case", list(DISAGREEMENTS))
def test_manifest_disagrees_with_graph(model_copy, case):
    change, fields = DISAGREEMENTS[case]
    edit_manifest(model_copy, change)
    message = load_error(model_copy)
    for field in (fields,) if isinstance(fields, str) else fields:
        assert field in message
    # The file at fault is named: the graph, or the manifest itself.
    assert str(model_copy / "model.onnx") in message or "manifest.json" in message


# A manifest that is wrong on its own: the message names the manifest and the field.
BAD_MANIFESTS = {
    "not JSON": (None, "not valid JSON"),
    "not an object": ([], "expected an object, got list"),
    "field missing": (lambda m: m.pop("name"), "field 'name' missing"),
    "wrong type": (lambda m: m.update(vocab_size="1000"), "field 'vocab_size' must be an integer"),
    "bool is no int": (lambda m: m.update(d_model=True), "field 'd_model' must be an integer"),
    "format": (lambda m: m.update(format="other/2"), "format is 'other/2'"),
    "V not positive": (lambda m: m.update(vocab_size=0), "vocab_size must be positive"),
    "scale not positive": (lambda m: m.update(scale=-1.0), "scale must be a positive number"),
    "weight dtype": (lambda m: m.update(weight_dtype="int8"), "weight_dtype 'int8' is not one of"),
    "padding out of range": (lambda m: m.update(padding_idx=1000), "padding_idx 1000 is outside"),
    "padding not int": (lambda m: m.update(padding_idx=1.5), "padding_idx must be an integer"),
    "output shape": (lambda m: m["output"].update(shape=["b", "s"]), "output.shape is ['b', 's']"),
    "input shape fixed": (lambda m: m["input"].update(shape=[1, "s"]), "input.shape is [1, 's']"),
    "no model file": (lambda m: m["files"].pop("model.onnx"), "files does not list model.onnx"),
    # --from-pretrained's record: what GetModelInfo reports must be well formed.
    "pretrained not an object": (
        lambda m: m.update(pretrained="llama"),
        "field 'pretrained' must be an object",
    ),
    "pretrained without architecture": (
        lambda m: m.update(pretrained={"convention": "c", "engine_scales": {}, "keys": {}}),
        "pretrained: field 'architecture' missing",
    ),
    "engine scale not positive": (
        lambda m: m.update(
            pretrained={
                "architecture": "llama",
                "convention": "c",
                "engine_scales": {"vllm": 0},
                "keys": {},
            }
        ),
        "engine_scales['vllm'] must be a positive number, got 0",
    ),
}


@pytest.mark.parametrize("case", list(BAD_MANIFESTS))
def test_bad_manifest(model_copy, case):
    change, fragment = BAD_MANIFESTS[case]
    path = model_copy / "manifest.json"
    if change is None:
        path.write_text("{not json")
    elif isinstance(change, list):
        path.write_text(json.dumps(change))
    else:
        edit_manifest(model_copy, change)
    message = load_error(model_copy)
    assert message.startswith(str(path)), message
    assert fragment in message


def test_loader_needs_no_torch(small_export):
    """The server imports the loader; torch must stay out of its process."""
    code = textwrap.dedent(
        f"""
        import sys
        from tokembed.export.model_dir import load_model_dir
        model = load_model_dir({str(small_export.path)!r})
        assert model.manifest.vocab_size == {small_export.vocab_size}
        assert "torch" not in sys.modules, "the loader imported torch"
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok\n"


def test_loader_works_with_torch_unimportable(small_export):
    """Same, but with torch made unimportable: a lazy `import torch` anywhere on the
    loading path would fail here even if something removed it from sys.modules."""
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        from tokembed.export.model_dir import load_model_dir
        load_model_dir({str(small_export.path)!r})
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok\n"
