"""The segment and factorized kinds checked against the library that defines them: tiny
BERT and ALBERT models built by Hugging Face ``transformers`` from a config with random
weights, saved with ``save_pretrained`` (safetensors; nothing is downloaded), exported by
key with ``tokembed export``, served by the real server (each backend) and asked through
the real client; the answers are compared with what the library's own modules compute
on the same ids.

- BERT: ``BertEmbeddings`` computes ``word_embeddings(ids) + token_type_embeddings(types)``,
  then adds ``position_embeddings`` and applies ``LayerNorm`` (and dropout). The source's
  layer is the token's embedding with its segment's, so the comparison is with that sum,
  computed by the library's two ``nn.Embedding`` modules and ``+`` as ``BertEmbeddings``
  writes it: exactly, bit for bit.
- ALBERT: ``AlbertEmbeddings`` looks up ``word_embeddings`` ``[V, D']`` and adds token
  types and positions and a LayerNorm; ``AlbertTransformer`` then projects with
  ``embedding_hidden_mapping_in`` (a Linear D' -> D). The source's layer is the look-up
  and its projection, so the comparison is with
  ``embedding_hidden_mapping_in(word_embeddings(ids))``: within the bound the manifest
  states (a matmul is not bit-exact across libraries), and the measured distance is
  checked to be below it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tokembed.cli.main import main
from tokembed.client import AsyncEmbeddingClient, EmbeddingClient, InvalidInputError

from support.fixtures import EVERY_BACKEND

V, D, INNER, TYPES = 1000, 32, 16, 2
BERT_WORDS = "embeddings.word_embeddings.weight"
BERT_TYPES = "embeddings.token_type_embeddings.weight"
ALBERT_WORDS = "embeddings.word_embeddings.weight"
ALBERT_PROJECTION = "encoder.embedding_hidden_mapping_in.weight"
ALBERT_BIAS = "encoder.embedding_hidden_mapping_in.bias"


def _tiny(kind: str, directory: Path) -> Any:
    """A tiny model of ``kind`` with seeded random weights, saved to ``directory``.
    (transformers, a pinned test dependency, is imported here: it takes seconds, which
    collecting the suite should not pay.)"""
    import transformers

    torch.manual_seed(1234)
    common = {
        "vocab_size": V,
        "hidden_size": D,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 37,
        "max_position_embeddings": 64,
        "type_vocab_size": TYPES,
        "pad_token_id": 0,
    }
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(**common))
    else:
        config = transformers.AlbertConfig(embedding_size=INNER, **common)
        model = transformers.AlbertModel(config)
        # The library starts the projection's bias at zero: a random one makes its
        # addition part of what is compared.
        with torch.no_grad():
            model.encoder.embedding_hidden_mapping_in.bias.normal_(0.0, 0.02)
    model.eval()
    model.save_pretrained(directory)
    assert (directory / "model.safetensors").is_file()
    return model


def _export(out: Path, *flags: object) -> None:
    code = main(["export", "--out", str(out), *(str(flag) for flag in flags)])
    assert code == 0


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    root = tmp_path_factory.mktemp("bert")
    model = _tiny("bert", root / "checkpoint")
    _export(
        root / "model",
        "--weights", root / "checkpoint" / "model.safetensors",
        "--key", BERT_WORDS, "--segment-key", BERT_TYPES, "--padding-idx", 0,
        "--name", "bert",
    )  # fmt: skip
    return model, root / "model"


@pytest.fixture(scope="module")
def albert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    root = tmp_path_factory.mktemp("albert")
    model = _tiny("albert", root / "checkpoint")
    _export(
        root / "model",
        "--weights", root / "checkpoint" / "model.safetensors",
        "--key", ALBERT_WORDS, "--projection-key", ALBERT_PROJECTION,
        "--projection-bias-key", ALBERT_BIAS, "--padding-idx", 0, "--name", "albert",
    )  # fmt: skip
    return model, root / "model"


def _bert_reference(model: Any, ids: np.ndarray, types: np.ndarray) -> np.ndarray:
    """What BertEmbeddings computes before it adds positions and normalises."""
    embeddings = model.embeddings
    with torch.no_grad():
        words = embeddings.word_embeddings(torch.from_numpy(ids))
        kinds = embeddings.token_type_embeddings(torch.from_numpy(types))
        return (words + kinds).numpy()  # type: ignore[no-any-return]


def _albert_reference(model: Any, ids: np.ndarray) -> np.ndarray:
    """ALBERT's look-up and projection, without the types, positions and LayerNorm its
    embedding block puts between them."""
    with torch.no_grad():
        rows = model.embeddings.word_embeddings(torch.from_numpy(ids))
        return model.encoder.embedding_hidden_mapping_in(rows).numpy()  # type: ignore[no-any-return]


def _manifest(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "manifest.json").read_text())  # type: ignore[no-any-return]


def _ids(seed: int, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, shape).astype(np.int64)
    ids[0, 0] = 0  # the padding id, whose row BERT's init made zero
    ids[-1, -1] = V - 1
    return ids, rng.integers(0, TYPES, shape).astype(np.int64)


def test_the_bert_export_is_a_segment_model_of_the_checkpoint(bert: tuple[Any, Path]) -> None:
    model, model_dir = bert
    manifest = _manifest(model_dir)
    assert manifest["kind"] == "segment"
    assert (manifest["vocab_size"], manifest["d_model"], manifest["type_vocab_size"]) == (
        V, D, TYPES,
    )  # fmt: skip
    assert manifest["scale"] == 1.0 and manifest["padding_idx"] == 0
    assert manifest["parity"]["tolerance"] == 0.0 and manifest["parity"]["max_abs_error"] == 0.0
    assert manifest["source"]["key"] == BERT_WORDS
    assert manifest["source"]["segment_key"] == BERT_TYPES
    assert model.embeddings.word_embeddings.weight[0].abs().max() == 0  # the padding row


@EVERY_BACKEND
def test_bert_answers_are_the_library_s_word_plus_type_embeddings_bit_for_bit(
    bert: tuple[Any, Path], start_server: Any, backend: dict[str, Any]
) -> None:
    model, model_dir = bert
    server = start_server(model_dir, **backend)
    ids, types = _ids(0, (3, 40))
    with EmbeddingClient(server.target) as client:
        info = client.info()
        got = client.embed(ids, token_types=types)
        alone = client.embed(ids)  # no types: every type is 0, as BERT defaults them
        large_ids, large_types = _ids(1, (4, 600))  # past the table's gather threshold
        large = client.embed(large_ids, token_types=large_types)
        half = client.embed(ids, "float16", token_types=types)
        ragged = client.embed_result(
            [ids[0, :5].tolist(), ids[1, :9].tolist()],
            token_types=[types[0, :5].tolist(), types[1, :9].tolist()],
        )
    assert info.backend == ("onnxruntime" if backend else "table")
    want = _bert_reference(model, ids, types)
    np.testing.assert_array_equal(got, want)
    assert got.tobytes() == want.tobytes()
    np.testing.assert_array_equal(alone, _bert_reference(model, ids, np.zeros_like(types)))
    np.testing.assert_array_equal(large, _bert_reference(model, large_ids, large_types))
    np.testing.assert_array_equal(half, want.astype(np.float16))
    # Ragged: each sequence's rows, then the padding id's row (with type 0) after the
    # shorter one, as the model computes it.
    pad = _bert_reference(model, np.zeros((1, 1), np.int64), np.zeros((1, 1), np.int64))[0, 0]
    states = ragged.hidden_states
    np.testing.assert_array_equal(states[0, :5], want[0, :5])
    np.testing.assert_array_equal(states[1, :9], want[1, :9])
    np.testing.assert_array_equal(states[0, 5:], np.tile(pad, (4, 1)))


def test_the_asyncio_client_sends_token_types_too(
    bert: tuple[Any, Path], start_server: Any
) -> None:
    model, model_dir = bert
    server = start_server(model_dir)
    ids, types = _ids(5, (2, 7))

    async def embed() -> tuple[np.ndarray, Any]:
        async with AsyncEmbeddingClient(server.target) as client:
            hidden = await client.embed(ids, token_types=types)
            result = await client.embed_result(ids, token_types=types)
            return hidden, result

    hidden, result = asyncio.run(embed())
    want = _bert_reference(model, ids, types)
    assert hidden.tobytes() == want.tobytes()
    assert result.hidden_states.tobytes() == want.tobytes()


@EVERY_BACKEND
def test_bert_type_ids_are_validated_as_ids_are(
    bert: tuple[Any, Path], start_server: Any, backend: dict[str, Any]
) -> None:
    _, model_dir = bert
    server = start_server(model_dir, **backend)
    ids, types = _ids(2, (2, 5))
    types[1, 3] = TYPES  # one past the last type
    with EmbeddingClient(server.target) as client:
        with pytest.raises(InvalidInputError) as error:
            client.embed(ids, token_types=types)
        assert "token_type_ids[1,3] = 2 is outside its range [0, 2)" in str(error.value)
        types[1, 3] = -1
        with pytest.raises(InvalidInputError, match=r"token_type_ids\[1,3\] = -1 is outside"):
            client.embed(ids, token_types=types)
        # One type per id, or the client refuses before sending.
        with pytest.raises(InvalidInputError, match="token_types must have the ids' shape"):
            client.embed(ids, token_types=[[0, 1]])


def test_model_info_and_listing_describe_the_bert_model(
    bert: tuple[Any, Path], start_server: Any
) -> None:
    _, model_dir = bert
    server = start_server(model_dir)
    with EmbeddingClient(server.target) as client:
        info = client.info()
        listed = client.models()["bert"]
    assert info == listed
    assert info.kind == "segment"
    assert [(i.name, i.bound, i.bound_field, i.optional) for i in info.inputs] == [
        ("input_ids", V, "vocab_size", False),
        ("token_type_ids", TYPES, "type_vocab_size", True),
    ]
    assert [(t.role, t.shape, t.dtype) for t in info.tables] == [
        ("embedding", (V, D), "float32"),
        ("segment", (TYPES, D), "float32"),
    ]
    # The table backend holds a row per (id, type): T * V rows, and their float16 and
    # bfloat16 casts, mapped from the table cache (on by default).
    assert info.backend == "table"
    rows = TYPES * V * D
    assert info.memory_bytes == {
        "mapped float32 table": rows * 4,
        "mapped float16 table": rows * 2,
        "mapped bfloat16 table": rows * 2,
    }
    assert info.serving_memory_bytes["table"] == rows * 8
    assert info.serving_memory_bytes["onnxruntime"] > (V + TYPES) * D * 4


def test_the_albert_export_is_a_factorized_model_with_its_bound(
    albert: tuple[Any, Path],
) -> None:
    model, model_dir = albert
    manifest = _manifest(model_dir)
    assert manifest["kind"] == "factorized"
    assert (manifest["vocab_size"], manifest["d_model"], manifest["factor_dim"]) == (V, D, INNER)
    assert manifest["scale"] == 1.0
    parity = manifest["parity"]
    # A stated bound, above zero (a matmul), that the export's own check met.
    assert 0 < parity["tolerance"] < 1e-4
    assert parity["max_abs_error"] <= parity["tolerance"]
    assert manifest["source"]["projection_key"] == ALBERT_PROJECTION
    assert manifest["source"]["projection_bias_key"] == ALBERT_BIAS
    assert model.encoder.embedding_hidden_mapping_in.bias.abs().max() > 0  # a real bias


@EVERY_BACKEND
def test_albert_answers_are_the_library_s_projected_rows_within_the_stated_bound(
    albert: tuple[Any, Path], start_server: Any, backend: dict[str, Any]
) -> None:
    model, model_dir = albert
    bound = _manifest(model_dir)["parity"]["tolerance"]
    server = start_server(model_dir, **backend)
    ids, _ = _ids(3, (3, 40))
    large_ids, _ = _ids(4, (4, 600))
    with EmbeddingClient(server.target) as client:
        info = client.info()
        got = client.embed(ids)
        large = client.embed(large_ids)
    assert info.kind == "factorized" and info.backend == ("onnxruntime" if backend else "table")
    assert [(t.role, t.shape) for t in info.tables] == [
        ("embedding", (V, INNER)),
        ("projection", (INNER, D)),
    ]
    for answer, asked in ((got, ids), (large, large_ids)):
        want = _albert_reference(model, asked)
        assert answer.shape == want.shape == (*asked.shape, D)
        distance = float(np.max(np.abs(answer.astype(np.float64) - want)))
        assert distance <= bound, (distance, bound)
        # Not trivially so: the rows are the projection's, not zeros or the table's.
        assert float(np.max(np.abs(want))) > 100 * bound


def test_a_factorized_model_is_served_from_its_table_when_it_fits_else_per_batch(
    albert: tuple[Any, Path], start_server: Any
) -> None:
    """The [V, D] table computed at load is chosen when it fits --float32-table-max-bytes;
    one byte less and the model runs per batch. GetModelInfo says which, and what each
    way holds."""
    _, model_dir = albert
    table_bytes = V * D * 4
    fits = start_server(model_dir, float32_table_max_bytes=table_bytes)
    over = start_server(model_dir, float32_table_max_bytes=table_bytes - 1)
    with EmbeddingClient(fits.target) as client:
        chosen = client.info()
    with EmbeddingClient(over.target) as client:
        fallback = client.info()
    assert chosen.backend == "table"
    assert chosen.memory_bytes["mapped float32 table"] == table_bytes
    assert fallback.backend == "onnxruntime"
    weights = V * INNER * 4 + INNER * D * 4 + D * 4
    assert fallback.memory_bytes["weights"] >= weights
    assert fallback.memory_bytes["batch arena"] > 0
    for info in (chosen, fallback):
        assert info.serving_memory_bytes["table"] >= table_bytes
        assert info.serving_memory_bytes["onnxruntime"] == sum(fallback.memory_bytes.values())


def test_the_command_line_embeds_with_token_types_and_describes_the_kinds(
    bert: tuple[Any, Path], albert: tuple[Any, Path], start_server: Any
) -> None:
    model, bert_dir = bert
    server = start_server((bert_dir, albert[1]))

    def cli(*args: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "tokembed.cli.main", *args, "--target", server.target],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    shown = cli("embed", "--ids", "5 6 7; 8 9", "--token-types", "0 1 1; 1 0", "--dtype",
                "float32")  # fmt: skip
    want = _bert_reference(model, np.array([[5, 6, 7]]), np.array([[0, 1, 1]]))
    assert "hidden_states [2, 3, 32] float32" in shown
    assert f"{want[0, 0, 0]:.4f}" in shown
    info = cli("info", "--model", "bert")
    assert "kind               segment" in info
    assert "token_type_ids [0, 2) (type_vocab_size, optional: 0)" in info
    assert "segment [2, 32] float32" in info
    table = cli("models").splitlines()
    assert table[0].split() == [
        "MODEL", "VERSION", "KIND", "V", "D", "WEIGHTS", "BACKEND", "MEMORY", "DEFAULT",
    ]  # fmt: skip
    assert table[1].split()[:3] == ["bert", "1", "segment"]
    assert table[2].split()[:3] == ["albert", "1", "factorized"]
