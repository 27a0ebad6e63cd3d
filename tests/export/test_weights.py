"""Loading the [V, D] matrix by key from a torch state_dict or a safetensors file, tied
checkpoints included, and exporting it through the command line."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tokembed.cli.main import main
from tokembed.export.errors import CheckpointError
from tokembed.export.model_dir import load_model_dir
from tokembed.export.weights import load_matrix

V, D = 300, 24


@pytest.fixture(scope="module")
def embedding() -> torch.Tensor:
    return torch.randn(V, D, generator=torch.Generator().manual_seed(42))


@pytest.fixture(scope="module")
def tied_pt(tmp_path_factory, embedding) -> Path:
    """A decoder-style state_dict whose input embedding and output projection are one
    tensor under two keys (as torch.save writes a tied model: one storage)."""
    state = {
        "model.embed_tokens.weight": embedding,
        "lm_head.weight": embedding,  # tied: the same tensor object
        "model.layers.0.mlp.weight": torch.randn(D, D),
        "model.layers.0.mlp.bias": torch.randn(D),
        "model.norm.scale": torch.randn(2, 3, 4),
    }
    path = tmp_path_factory.mktemp("ckpt") / "model.pt"
    torch.save(state, path)
    # Prove the fixture is what it claims: the file holds one storage under both keys.
    reloaded = torch.load(path, weights_only=True)
    assert (
        reloaded["model.embed_tokens.weight"].untyped_storage().data_ptr()
        == reloaded["lm_head.weight"].untyped_storage().data_ptr()
    )
    return path


@pytest.fixture(scope="module")
def tied_safetensors(tmp_path_factory, embedding) -> Path:
    """The safetensors form of a tied checkpoint.

    safetensors' save_file refuses tensors that share memory ("Some tensors share
    memory"), so a tied safetensors checkpoint never holds one storage under two names.
    In practice it comes in one of two forms: transformers' save_pretrained keeps only one
    of the tied names (e.g. ``model.embed_tokens.weight``, no ``lm_head.weight``) and
    re-ties on load, or a saver that clones writes the same data under both names. The
    first is an ordinary single key; this fixture is the second: two keys, equal data.
    """
    state = {
        "model.embed_tokens.weight": embedding.clone(),
        "lm_head.weight": embedding.clone(),
        "model.layers.0.mlp.weight": torch.randn(D, D),
        "model.layers.0.mlp.bias": torch.randn(D),
    }
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    save_file(state, str(path))
    return path


# --- load_matrix ------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["model.embed_tokens.weight", "lm_head.weight"])
@pytest.mark.parametrize("fixture", ["tied_pt", "tied_safetensors"])
def test_load_by_key_from_a_tied_checkpoint(request, fixture, key, embedding):
    matrix = load_matrix(request.getfixturevalue(fixture), key)
    assert matrix.dtype == torch.float32
    assert torch.equal(matrix, embedding)


def test_loaded_matrix_does_not_alias_the_checkpoint(tied_pt):
    # Tied keys share storage in the file; the matrix handed to the exporter is its own.
    first = load_matrix(tied_pt, "model.embed_tokens.weight")
    second = load_matrix(tied_pt, "lm_head.weight")
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()


def test_legacy_torch_format_loads(tmp_path, embedding):
    # torch < 1.6 wrote a plain pickle stream (many early Hugging Face .bin files); it
    # cannot be memory-mapped, but it is still read, still without running code.
    path = tmp_path / "pytorch_model.bin"
    torch.save(
        {"embeddings.word_embeddings.weight": embedding}, path, _use_new_zipfile_serialization=False
    )
    assert torch.equal(load_matrix(path, "embeddings.word_embeddings.weight"), embedding)


def test_nested_state_dict_keys_are_dotted(tmp_path, embedding):
    path = tmp_path / "ckpt.bin"
    torch.save({"model": {"embed": {"weight": embedding}}, "step": 10}, path)
    assert torch.equal(load_matrix(path, "model.embed.weight"), embedding)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_other_float_dtypes_are_widened_to_float32(tmp_path, dtype, suffix, embedding):
    stored = embedding.to(dtype)
    path = tmp_path / f"ckpt{suffix}"
    if suffix == ".pt":
        torch.save({"w": stored}, path)
    else:
        save_file({"w": stored}, str(path))
    matrix = load_matrix(path, "w")
    assert matrix.dtype == torch.float32
    assert torch.equal(matrix, stored.to(torch.float32))


@pytest.mark.parametrize("fixture", ["tied_pt", "tied_safetensors"])
def test_missing_key_lists_the_2d_matrices(request, fixture):
    path = request.getfixturevalue(fixture)
    with pytest.raises(CheckpointError) as info:
        load_matrix(path, "embed.weight")
    message = str(info.value)
    assert "'embed.weight' not found" in message
    assert message.endswith(
        "keys holding 2-D matrices: lm_head.weight, model.embed_tokens.weight, "
        "model.layers.0.mlp.weight"
    )
    assert "bias" not in message and "norm" not in message


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_not_a_2d_matrix(tmp_path, suffix):
    path = tmp_path / f"ckpt{suffix}"
    tensors = {"bias": torch.zeros(7), "cube": torch.zeros(2, 3, 4)}
    if suffix == ".pt":
        torch.save(tensors, path)
    else:
        save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"'bias' .* has shape \[7\], expected a 2-D"):
        load_matrix(path, "bias")
    with pytest.raises(CheckpointError, match=r"has shape \[2, 3, 4\]"):
        load_matrix(path, "cube")


def test_integer_matrix_is_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"ids": torch.zeros(3, 4, dtype=torch.int64)}, path)
    with pytest.raises(CheckpointError, match=r"is torch\.int64, expected a float matrix"):
        load_matrix(path, "ids")


class _Payload:
    """Unpickling this would create ``marker``; weights_only loading must refuse it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_pickled_code_is_never_run(tmp_path, zip_format):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    state = {"w": torch.zeros(2, 2), "x": _Payload(marker)}
    torch.save(state, path, _use_new_zipfile_serialization=zip_format)
    assert not marker.exists()
    with pytest.raises(
        CheckpointError, match=r"cannot read checkpoint evil\.pt: Weights only load"
    ):
        load_matrix(path, "w")
    assert not marker.exists()
    # The payload is live: a plain (unsafe) unpickle would have run it.
    torch.load(path, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("ckpt.pt", b"not a checkpoint", "cannot read checkpoint ckpt.pt"),
        ("ckpt.safetensors", b"\x00" * 3, "cannot read checkpoint ckpt.safetensors"),
        ("ckpt.npz", b"", r"unknown checkpoint type '\.npz'"),
    ],
)
def test_unreadable_checkpoints(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=match):
        load_matrix(path, "w")


def test_bare_tensor_is_not_a_state_dict(tmp_path, embedding):
    path = tmp_path / "ckpt.pt"
    torch.save(embedding, path)
    with pytest.raises(CheckpointError, match="holds a bare tensor"):
        load_matrix(path, "w")


# --- through the command line -----------------------------------------------------------


@pytest.mark.parametrize("fixture", ["tied_pt", "tied_safetensors"])
def test_export_from_a_tied_checkpoint(request, tmp_path, capsys, bitwise_equal, fixture):
    import onnxruntime as ort

    path = request.getfixturevalue(fixture)
    embedding = request.getfixturevalue("embedding")
    out = tmp_path / "model"
    code = main(["export", "--out", str(out), "--weights", str(path), "--key", "lm_head.weight"])
    assert code == 0, capsys.readouterr().err
    assert f"V={V} D={D}" in capsys.readouterr().out

    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["vocab_size"], manifest["d_model"]) == (V, D)
    assert manifest["source"] == {
        "kind": "checkpoint",
        "file": path.name,
        "key": "lm_head.weight",
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }
    load_model_dir(out)
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.arange(V, dtype=np.int64).reshape(3, -1)
    got = session.run(None, {"input_ids": ids})[0]
    bitwise_equal(got, embedding.numpy()[ids] * np.float32(math.sqrt(D)))


def test_checkpoint_padding_row_is_kept_as_trained(tmp_path, capsys, tied_pt, embedding):
    """--padding-idx records the id; the checkpoint's row is exported as it is (zeroing
    it would make the export compute something the model does not)."""
    import onnxruntime as ort

    out = tmp_path / "model"
    argv = ["export", "--out", str(out), "--weights", str(tied_pt)]
    argv += ["--key", "lm_head.weight", "--padding-idx", "4", "--scale", "none"]
    assert main(argv) == 0, capsys.readouterr().err
    assert json.loads((out / "manifest.json").read_text())["padding_idx"] == 4
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    row = session.run(None, {"input_ids": np.array([[4]], dtype=np.int64)})[0][0, 0]
    np.testing.assert_array_equal(row, embedding[4].numpy())


def test_checkpoint_shape_must_match_given_sizes(tmp_path, capsys, tied_pt):
    argv = ["export", "--out", str(tmp_path / "m"), "--weights", str(tied_pt)]
    argv += ["--key", "lm_head.weight", "--vocab-size", str(V + 1)]
    assert main(argv) == 2
    assert f"--vocab-size {V + 1} disagrees with the checkpoint's {V}" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
