"""nearest for the segment and factorized kinds, end to end: exported from a checkpoint by
the real command line with the output projection tied, served by the real server, asked
through the real client (docs/export.md, "The head of each kind").

- segment (BERT: ``E[id] * scale + S[t]``): the head is over the word table ``E``, the
  one BERT's decoder is tied to. A served vector of type ``t`` less its type row ``S[t]``
  is its word row: its cosine top-1 is its own id, for every id and type; random vectors'
  top-k are ``torch.topk`` over ``E``.
- factorized (ALBERT: ``E [V, D'] P + b``): the head is over the served vectors of every
  id, computed at export. The head's table is the look-up's answers bit for bit (and,
  served by the table backend, the look-up's own rows);
  every id's served vector's cosine top-1 is itself; random vectors' top-k are
  ``torch.topk`` over torch's own ``E P + b``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tokembed.cli.main import main
from tokembed.client import EmbeddingClient
from tokembed.export.head import HEAD_DATA_NAME, head_table
from tokembed.export.manifest import Manifest

V, D, D_INNER, T = 300, 32, 8, 2
K = 5


def _checkpoint(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file({key: value.contiguous() for key, value in tensors.items()}, str(path))
    return path


@pytest.fixture(scope="module")
def segment(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    root = tmp_path_factory.mktemp("segment")
    generator = torch.Generator().manual_seed(21)
    words = torch.randn(V, D, generator=generator)
    types = torch.randn(T, D, generator=generator) * 0.5
    checkpoint = _checkpoint(root / "bert.safetensors", {
        "word": words, "type": types, "decoder": words.clone(),
    })  # fmt: skip
    out = root / "segment"
    assert main(["export", "--out", str(out), "--weights", str(checkpoint), "--key", "word",
                 "--segment-key", "type", "--output-key", "decoder"]) == 0  # fmt: skip
    return out, words, types


@pytest.fixture(scope="module")
def factorized(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    root = tmp_path_factory.mktemp("factorized")
    generator = torch.Generator().manual_seed(22)
    words = torch.randn(V, D_INNER, generator=generator)
    weight = torch.randn(D, D_INNER, generator=generator) * D_INNER**-0.5  # a Linear's [D, D']
    bias = torch.randn(D, generator=generator) * 0.1
    checkpoint = _checkpoint(root / "albert.safetensors", {
        "word": words, "projection": weight, "bias": bias, "decoder": words.clone(),
    })  # fmt: skip
    out = root / "factorized"
    assert main(["export", "--out", str(out), "--weights", str(checkpoint), "--key", "word",
                 "--projection-key", "projection", "--projection-bias-key", "bias",
                 "--output-key", "decoder"]) == 0  # fmt: skip
    with torch.no_grad():  # torch's own computation of the served table
        served = torch.nn.functional.linear(words, weight, bias)
    return out, served


def _random_vectors(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1000, D)).astype(np.float32)


def _assert_exact(client: EmbeddingClient, h: np.ndarray, table: torch.Tensor) -> None:
    """ids are ``torch.topk``'s over ``table`` (float32, as in tests/e2e/test_nearest.py),
    scores within 1e-5 relative, for dot and cosine."""
    vectors = torch.from_numpy(h)
    dot = client.nearest(h, k=K)
    want_scores, want_ids = torch.topk(vectors @ table.T, K)
    np.testing.assert_array_equal(dot.ids, want_ids.numpy())
    np.testing.assert_allclose(dot.scores, want_scores.numpy(), rtol=1e-5)
    cosine = client.nearest(h, k=K, metric="cosine")
    normalize = torch.nn.functional.normalize
    cos_scores, cos_ids = torch.topk(normalize(vectors) @ normalize(table).T, K)
    np.testing.assert_array_equal(cosine.ids, cos_ids.numpy())
    np.testing.assert_allclose(cosine.scores, cos_scores.numpy(), rtol=1e-5)


def test_segment_head_is_the_word_table(segment, start_server) -> None:
    out, words, types = segment
    manifest = Manifest.read(out)
    assert manifest.kind == "segment" and manifest.head is not None
    assert (manifest.head.table, manifest.head.output_key) == ("embedding", "decoder")
    assert HEAD_DATA_NAME not in manifest.files  # the word table's own bytes, no copy
    server = start_server(out)
    ids = np.arange(V, dtype=np.int64)[None, :]
    with EmbeddingClient(server.target) as client:
        assert client.info().head is not None
        for t in range(T):
            served = client.embed(ids, token_types=np.full_like(ids, t))[0]
            word_rows = served - types[t].numpy()
            found = client.nearest(word_rows, k=1, metric="cosine")
            np.testing.assert_array_equal(found.ids[:, 0], np.arange(V))
        _assert_exact(client, _random_vectors(5), words)


def test_factorized_head_is_the_served_table(factorized, start_server) -> None:
    out, served_by_torch = factorized
    manifest = Manifest.read(out)
    assert manifest.kind == "factorized" and manifest.head is not None
    assert (manifest.head.table, manifest.head.weight_dtype) == ("served", "float32")
    held = np.asarray(head_table(out, manifest))
    server = start_server(out)
    with EmbeddingClient(server.target) as client:
        served = client.embed(np.arange(V, dtype=np.int64)[None, :])[0]
        info = client.info()
        # The head's table is what the look-up answers, bit for bit.
        np.testing.assert_array_equal(held, served)
        found = client.nearest(served, k=1, metric="cosine")
        np.testing.assert_array_equal(found.ids[:, 0], np.arange(V))
        _assert_exact(client, _random_vectors(6), served_by_torch)
    assert info.head is not None and info.head.table == "served"
    # Served by the table backend, whose float32 rows hold the same bytes: the head reads
    # them (one copy of the served vectors), not a mapped table of its own.
    assert not [key for key in info.memory_bytes if "head" in key], info.memory_bytes


def test_a_random_model_of_each_kind_takes_tied_head(tmp_path: Path) -> None:
    for kind, table in (("segment", "embedding"), ("factorized", "served")):
        out = tmp_path / kind
        argv = ["export", "--out", str(out), "--kind", kind, "--vocab-size", "64",
                "--d-model", "8", "--tied-head"]  # fmt: skip
        assert main(argv) == 0
        head = Manifest.read(out).head
        assert head is not None and head.table == table


def test_an_untied_factorized_output_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ALBERT's decoder is [V, D'] and tied; an untied one has no served table to be."""
    generator = torch.Generator().manual_seed(23)
    checkpoint = _checkpoint(tmp_path / "untied.safetensors", {
        "word": torch.randn(V, D_INNER, generator=generator),
        "projection": torch.randn(D, D_INNER, generator=generator),
        "decoder": torch.randn(V, D_INNER, generator=generator),
    })  # fmt: skip
    out = tmp_path / "m"
    code = main(["export", "--out", str(out), "--weights", str(checkpoint), "--key", "word",
                 "--projection-key", "projection", "--output-key", "decoder"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "must be tied to the [V, D'] table" in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
