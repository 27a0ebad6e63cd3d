"""Weight tying in the manifest: ``--output-projection KEY`` records whether the exported
table is also the model's output projection, and how the exporter knows.

Each form a tie takes in a checkpoint, and each way it can be absent: one storage under
two keys (torch files), equal copies under two keys, one key and a ``config.json``
declaring ``tie_word_embeddings`` (transformers' safetensors), a different matrix
(untied), and a missing key with nothing to say it is tied (refused).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import save_file

from tokembed.cli.main import main
from tokembed.export.manifest import Manifest, Tie

V, D = 300, 24
EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"


@pytest.fixture(scope="module")
def embedding() -> torch.Tensor:
    return torch.randn(V, D, generator=torch.Generator().manual_seed(3))


def _export(capsys, tmp_path: Path, weights: Path, *flags: str) -> tuple[int, str, str]:
    out = tmp_path / "model"
    code = main(["export", "--out", str(out), "--weights", str(weights), "--key", EMBED, *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _tie_of(tmp_path: Path) -> Tie | None:
    return Manifest.read(tmp_path / "model").tie


def test_shared_storage_in_a_torch_file(tmp_path, capsys, embedding):
    path = tmp_path / "model.pt"
    torch.save({EMBED: embedding, HEAD: embedding, "other.weight": torch.randn(D, D)}, path)
    code, out, err = _export(capsys, tmp_path, path, "--output-projection", HEAD)
    assert code == 0, err
    assert _tie_of(tmp_path) == Tie(HEAD, True, "shared storage", [EMBED, HEAD])
    assert f"tied to the output projection {HEAD} (shared storage)" in out


def test_equal_copies_in_a_safetensors_file(tmp_path, capsys, embedding):
    path = tmp_path / "model.safetensors"
    save_file({EMBED: embedding.clone(), HEAD: embedding.clone()}, str(path))
    code, _, err = _export(capsys, tmp_path, path, "--output-projection", HEAD)
    assert code == 0, err
    assert _tie_of(tmp_path) == Tie(HEAD, True, "equal values", [EMBED])


def test_one_bit_apart_is_not_tied(tmp_path, capsys, embedding):
    """Equal values means bit for bit: the last row's last value one ulp off is untied."""
    other = embedding.clone()
    other[-1, -1] = torch.nextafter(other[-1, -1], torch.tensor(float("inf")))
    path = tmp_path / "model.safetensors"
    save_file({EMBED: embedding.clone(), HEAD: other}, str(path))
    code, out, err = _export(capsys, tmp_path, path, "--output-projection", HEAD)
    assert code == 0, err
    assert _tie_of(tmp_path) == Tie(HEAD, False, "different values", [EMBED])
    assert f"not tied to the output projection {HEAD}" in out


def test_a_projection_of_another_shape_or_dtype_is_not_tied(tmp_path, capsys, embedding):
    path = tmp_path / "model.safetensors"
    save_file({EMBED: embedding.clone(), HEAD: embedding.to(torch.float16)}, str(path))
    code, _, err = _export(capsys, tmp_path, path, "--output-projection", HEAD)
    assert code == 0, err
    assert _tie_of(tmp_path) == Tie(
        HEAD, False, f"a different matrix ([{V}, {D}] torch.float16)", [EMBED]
    )


def _config(directory: Path, **fields: object) -> None:
    (directory / "config.json").write_text(json.dumps(fields))


def test_stored_once_and_declared_by_config_json(tmp_path, capsys, embedding):
    """transformers' save_pretrained writes a tied matrix under one name; its config.json
    says the output projection is tied to the word embeddings."""
    path = tmp_path / "model.safetensors"
    save_file({EMBED: embedding.clone()}, str(path))
    _config(tmp_path, tie_word_embeddings=True, vocab_size=V, hidden_size=D)
    code, _, err = _export(capsys, tmp_path, path, "--output-projection", HEAD)
    assert code == 0, err
    tie = _tie_of(tmp_path)
    assert tie is not None and tie.tied and tie.keys == [EMBED]
    assert tie.evidence.startswith("config.json: tie_word_embeddings")


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        (None, "and no config.json beside it declares a tie"),
        ({"tie_word_embeddings": False, "vocab_size": V, "hidden_size": D}, "does not declare"),
        ({"vocab_size": V, "hidden_size": D}, "does not declare tie_word_embeddings: true"),
        (
            {"tie_word_embeddings": True, "vocab_size": V + 1, "hidden_size": D},
            f"for a [{V + 1}, {D}] vocabulary, but {EMBED!r} is [{V}, {D}]",
        ),
        (
            {"tie_word_embeddings": True, "vocab_size": V, "d_model": D + 1},
            f"for a [{V}, {D + 1}] vocabulary",
        ),
    ],
)
def test_absent_projection_without_a_matching_declaration_is_refused(
    tmp_path, capsys, embedding, config, fragment
):
    path = tmp_path / "model.safetensors"
    save_file({EMBED: embedding.clone()}, str(path))
    if config is not None:
        _config(tmp_path, **config)
    code, out, err = _export(capsys, tmp_path, path, "--output-projection", HEAD)
    assert code == 2
    assert f"--output-projection {HEAD!r} is not in model.safetensors" in err
    assert fragment in err
    assert len(err.strip().splitlines()) == 1 and out == ""
    assert not (tmp_path / "model").exists()


def test_no_flag_no_tie(tmp_path, capsys, embedding):
    path = tmp_path / "model.pt"
    torch.save({EMBED: embedding, HEAD: embedding}, path)
    code, _, err = _export(capsys, tmp_path, path)
    assert code == 0, err
    assert "tie" not in json.loads((tmp_path / "model" / "manifest.json").read_text())
    assert _tie_of(tmp_path) is None


def test_the_projection_in_another_shard(tmp_path, capsys, embedding):
    """A sharded checkpoint: the projection's shard is read for the comparison."""
    state = {EMBED: embedding.clone(), HEAD: embedding.clone(), "norm.weight": torch.ones(D)}
    save_torch_state_dict(state, tmp_path, max_shard_size="20KB")
    index = tmp_path / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    assert weight_map[EMBED] != weight_map[HEAD]
    code, _, err = _export(capsys, tmp_path, index, "--output-projection", HEAD)
    assert code == 0, err
    assert _tie_of(tmp_path) == Tie(HEAD, True, "equal values", [EMBED])


def test_sharded_stored_once_reads_no_other_shard(tmp_path, capsys, embedding):
    """The projection is not in the index: the index and config.json answer, and no other
    shard is opened (they are deleted)."""
    state = {EMBED: embedding.clone(), "norm.weight": torch.ones(D), "other.weight": torch.ones(D)}
    save_torch_state_dict(state, tmp_path, max_shard_size="1KB")
    index = tmp_path / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    for shard in set(weight_map.values()) - {weight_map[EMBED]}:
        (tmp_path / shard).unlink()
    _config(tmp_path, tie_word_embeddings=True, vocab_size=V, d_model=D)
    code, _, err = _export(capsys, tmp_path, index, "--output-projection", HEAD)
    assert code == 0, err
    tie = _tie_of(tmp_path)
    assert tie is not None and tie.tied


def test_output_projection_needs_weights(tmp_path, capsys):
    code = main(["export", "--out", str(tmp_path / "m"), "--output-projection", HEAD])
    assert code == 2
    assert "--output-projection needs --weights" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("tie", "message"),
    [
        ({"tied": "yes"}, "field 'tied' must be true or false"),
        ({"keys": []}, "field 'keys' must be a non-empty list"),
        ({"output_projection": 3}, "field 'output_projection' must be a string"),
    ],
)
def test_a_manifest_with_a_malformed_tie_is_refused(tie, message):
    from tokembed.export.errors import ModelDirError

    good = {"output_projection": HEAD, "tied": True, "evidence": "shared storage", "keys": [EMBED]}
    raw = json.loads(Manifest.from_dict(_minimal()).to_json())
    raw["tie"] = {**good, **tie}
    with pytest.raises(ModelDirError, match=message):
        Manifest.from_dict(raw)
    raw["tie"] = good
    assert Manifest.from_dict(raw).tie == Tie(HEAD, True, "shared storage", [EMBED])


def _minimal() -> dict[str, object]:
    spec = {"name": "x", "dtype": "int64", "shape": ["batch", "sequence"]}
    return {
        "format": "tokembed-model/1",
        "name": "m",
        "version": "1",
        "vocab_size": V,
        "d_model": D,
        "scale": 1.0,
        "padding_idx": None,
        "weight_dtype": "float32",
        "input": spec,
        "output": {**spec, "dtype": "float32", "shape": ["batch", "sequence", D]},
        "opset": 20,
        "files": {},
        "producer": {},
        "parity": {"max_abs_error": 0.0, "tolerance": 0.0, "ids_checked": 2},
    }
