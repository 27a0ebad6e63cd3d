"""Sharded checkpoints: ``--weights`` names a ``*.safetensors.index.json`` or a
``pytorch_model.bin.index.json``, and the matrix is read from the shard the index names
for ``--key``, and from nothing else.

The checkpoints are written by huggingface_hub's ``save_torch_state_dict``, the writer
transformers uses (its layout: ``model-00001-of-0000N.safetensors`` or
``pytorch_model-00001-of-0000N.bin`` beside an index whose ``weight_map`` names each
key's shard), with a shard size small enough that every matrix has a shard of its own.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from huggingface_hub import save_torch_state_dict

from tokembed.cli.main import main
from tokembed.export.errors import CheckpointError
from tokembed.export.model_dir import load_model_dir
from tokembed.export.weights import load_matrix, open_matrix

V, D = 500, 40
EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
INDEX = {True: "model.safetensors.index.json", False: "pytorch_model.bin.index.json"}


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {
        EMBED: torch.randn(V, D, generator=generator),
        "model.layers.0.mlp.weight": torch.randn(D, D, generator=generator),
        "model.layers.0.mlp.bias": torch.randn(D, generator=generator),
        "model.norm.weight": torch.randn(D, generator=generator),
        HEAD: torch.randn(V, D, generator=generator),
    }


@pytest.fixture(scope="module", params=[True, False], ids=["safetensors", "bin"])
def sharded(request, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """(the index, the state it holds), sharded so that each matrix is in its own shard."""
    safe = request.param
    directory = tmp_path_factory.mktemp("sharded")
    state = _state()
    # 20 kB: smaller than either [V, D] matrix (80 kB), so each has a shard of its own.
    save_torch_state_dict(state, directory, safe_serialization=safe, max_shard_size="20KB")
    index = directory / INDEX[safe]
    weight_map = json.loads(index.read_text())["weight_map"]
    assert weight_map[EMBED] != weight_map[HEAD]
    assert len(set(weight_map.values())) >= 3
    return index, state


def _shard(index: Path, key: str) -> Path:
    return index.parent / json.loads(index.read_text())["weight_map"][key]


def _copy_with_only(index: Path, keep: str, into: Path) -> Path:
    """The index and the one shard holding ``keep``: every other shard is gone."""
    into.mkdir()
    (into / index.name).write_bytes(index.read_bytes())
    shard = _shard(index, keep)
    (into / shard.name).write_bytes(shard.read_bytes())
    return into / index.name


def test_load_by_key_through_the_index(sharded):
    index, state = sharded
    assert torch.equal(load_matrix(index, EMBED), state[EMBED])
    assert torch.equal(load_matrix(index, HEAD), state[HEAD])


def test_only_the_keys_shard_is_read(sharded, tmp_path, capsys, bitwise_equal):
    """Every shard but the one holding the key is deleted: nothing else can have been read,
    and the export is the same, down to the bytes of its table."""
    index, state = sharded
    alone = _copy_with_only(index, EMBED, tmp_path / "alone")
    shards_left = [p for p in alone.parent.iterdir() if p.name != index.name]
    assert len(shards_left) == 1

    out = tmp_path / "model"
    code = main(["export", "--out", str(out), "--weights", str(alone), "--key", EMBED])
    assert code == 0, capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    shard = shards_left[0]
    assert manifest["source"] == {
        "kind": "checkpoint",
        "file": index.name,
        "key": EMBED,
        "sha256": hashlib.sha256(alone.read_bytes()).hexdigest(),
        "shard": shard.name,
        "shard_sha256": hashlib.sha256(shard.read_bytes()).hexdigest(),
    }
    load_model_dir(out)
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.arange(V, dtype=np.int64).reshape(4, -1)
    got = session.run(None, {"input_ids": ids})[0]
    bitwise_equal(got, state[EMBED].numpy()[ids] * np.float32(math.sqrt(D)))


def test_an_index_naming_a_missing_shard_for_the_key(sharded, tmp_path):
    index, _ = sharded
    alone = _copy_with_only(index, HEAD, tmp_path / "alone")
    missing = _shard(index, EMBED).name
    with pytest.raises(CheckpointError, match=rf"checkpoint not found: .*{missing} \(a shard "):
        open_matrix(alone, EMBED)


def test_a_key_the_index_lacks_lists_the_matrices_of_every_shard(sharded):
    index, _ = sharded
    with pytest.raises(CheckpointError) as info:
        open_matrix(index, "embed.weight")
    assert str(info.value) == (
        f"key 'embed.weight' not found in {index.name}; keys holding 2-D matrices: "
        f"{HEAD}, {EMBED}, model.layers.0.mlp.weight"
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "cannot read checkpoint index"),
        ('{"metadata": {}}', "not a checkpoint index"),
        ('{"weight_map": {"w": 3}}', "not a checkpoint index"),
        ('{"weight_map": {"w": "../elsewhere.safetensors"}}', "outside the index's directory"),
        ('{"weight_map": {"w": "/etc/passwd"}}', "outside the index's directory"),
    ],
)
def test_bad_indexes_are_refused(tmp_path, content, message):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(content)
    with pytest.raises(CheckpointError, match=message):
        open_matrix(index, "w")


def test_an_index_shard_of_an_unknown_type(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"w": "model.npz"}}')
    (tmp_path / "model.npz").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"unknown checkpoint type '\.npz'"):
        open_matrix(index, "w")
