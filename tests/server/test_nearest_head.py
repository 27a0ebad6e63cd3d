"""The CPU search of ``backends.head``: top-k order (equal scores by the lower id, also
across the k-th place), a batch of several requests equal to each alone, cosine, the
final norm against transformers' own modules' arithmetic (torch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokembed.server.backends.head import FinalNorm, NearestHead, Query


def test_equal_scores_are_ordered_by_the_lower_id():
    """Rows 1, 2 and 4 are the same row: their scores are equal, whatever the vector."""
    rng = np.random.default_rng(7)
    table = rng.standard_normal((6, 8)).astype(np.float32)
    table[2] = table[4] = table[1]
    h = table[1:2] * 3  # rows 1, 2, 4 score highest
    head = NearestHead(table, None, "embedding", shared=False)
    for metric in ("dot", "cosine"):
        (two,) = head.search([Query(h, 2, metric, False, False)])
        assert two.ids.tolist() == [[1, 2]]  # three equal scores, two places: lowest ids
        (four,) = head.search([Query(h, 4, metric, False, False)])
        assert four.ids[0, :3].tolist() == [1, 2, 4]
        assert four.scores[0, 0] == four.scores[0, 1] == four.scores[0, 2]


def test_ties_everywhere_match_a_stable_sort_of_the_float64_scores():
    rng = np.random.default_rng(3)
    # Small integers: many rows score alike, at the k-th place too.
    table = rng.integers(-2, 3, size=(50, 4)).astype(np.float32)
    h = rng.integers(-2, 3, size=(100, 4)).astype(np.float32)
    head = NearestHead(table, None, "embedding", shared=False)
    scores = h.astype(np.float64) @ table.astype(np.float64).T
    for k in (1, 3, 7, 50):
        (found,) = head.search([Query(h, k, "dot", False, False)])
        want = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(found.ids, want)


def _head(norm: FinalNorm | None = None, vocab: int = 300, width: int = 16) -> NearestHead:
    table = np.random.default_rng(0).standard_normal((vocab, width)).astype(np.float32)
    return NearestHead(table, norm, "embedding", shared=False)


def test_a_batch_answers_each_request_as_it_would_alone():
    head = _head()
    rng = np.random.default_rng(1)
    queries = [
        Query(rng.standard_normal((n, 16)).astype(np.float32), k, metric, logits, False)
        for n, k, metric, logits in [(3, 5, "dot", True), (1, 1, "cosine", False),
                                     (7, 300, "dot", False), (2, 4, "cosine", True)]
    ]  # fmt: skip
    together = head.search(queries)
    for query, found in zip(queries, together, strict=True):
        (alone,) = head.search([query])
        # Exactly: the scores are re-computed per vector, whatever BLAS did for the batch.
        np.testing.assert_array_equal(found.ids, alone.ids)
        np.testing.assert_array_equal(found.scores, alone.scores)
        assert (found.logits is None) == (not query.logits)
        if query.logits:  # the float32 multiply's: within its error bound of each other
            np.testing.assert_allclose(found.logits, alone.logits, rtol=0, atol=1e-4)


def test_a_batch_larger_than_one_slice_of_logits(monkeypatch):
    """Rows split across slices of the logits (a request spanning two) answer the same."""
    import tokembed.server.backends.head as module

    head = _head(vocab=300)
    rng = np.random.default_rng(2)
    queries = [Query(rng.standard_normal((n, 16)).astype(np.float32), 3, "dot", True, False)
               for n in (5, 9, 2)]  # fmt: skip
    whole = head.search(queries)
    monkeypatch.setattr(module, "_LOGITS_CHUNK_BYTES", 4 * 300 * 4)  # 4 rows a slice
    sliced = head.search(queries)
    for a, b in zip(whole, sliced, strict=True):
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_array_equal(a.scores, b.scores)


def test_cosine_matches_torch():
    head = _head()
    h = np.random.default_rng(4).standard_normal((50, 16)).astype(np.float32)
    (found,) = head.search([Query(h, 5, "cosine", False, False)])
    table = torch.from_numpy(head.table)
    cos = (
        torch.nn.functional.normalize(torch.from_numpy(h)) @ torch.nn.functional.normalize(table).T
    )
    values, ids = torch.topk(cos, 5)
    np.testing.assert_array_equal(found.ids, ids.numpy())
    np.testing.assert_allclose(found.scores, values.numpy(), rtol=1e-5)


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_final_norm_matches_torch(kind):
    rng = np.random.default_rng(5)
    weight = rng.standard_normal(16).astype(np.float32)
    bias = rng.standard_normal(16).astype(np.float32) if kind == "layernorm" else None
    norm = FinalNorm(kind, 1e-5, weight, bias)
    h = (rng.standard_normal((20, 16)) * 3).astype(np.float32)
    if kind == "rmsnorm":
        module: torch.nn.Module = torch.nn.RMSNorm(16, eps=1e-5)
    else:
        module = torch.nn.LayerNorm(16, eps=1e-5)
        module.bias.data = torch.from_numpy(bias)
    module.weight.data = torch.from_numpy(weight)
    with torch.no_grad():
        want = module(torch.from_numpy(h)).numpy()
    np.testing.assert_allclose(norm.apply(h), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_narrow_table_is_read_as_stored_in_blocks_and_answers_exactly(dtype, monkeypatch):
    """The head multiplies the table it is given, in its stored dtype (no widened copy),
    a block of rows at a time: top-k equal to a stable sort of the exact (float64) scores
    of the stored values, alone and in a batch, whatever the block size (one row, a block
    that does not divide V, the whole table)."""
    import ml_dtypes

    import tokembed.server.backends.head_blocks as blocks_module

    numpy_dtype = {"float32": np.float32, "float16": np.float16,
                   "bfloat16": ml_dtypes.bfloat16}[dtype]  # fmt: skip
    rng = np.random.default_rng(5)
    vocab, width = 301, 24
    table = rng.standard_normal((vocab, width)).astype(numpy_dtype)
    table[7] = table[100]  # equal scores: ordered by the lower id
    h = rng.standard_normal((40, width)).astype(np.float32)
    h[0] = table[100].astype(np.float32)
    exact = h.astype(np.float64) @ table.astype(np.float64).T
    cosine = exact / (np.linalg.norm(h.astype(np.float64), axis=1)[:, None]
                      * np.linalg.norm(table.astype(np.float64), axis=1)[None, :])  # fmt: skip
    answers = {}
    for block_rows in (1, 37, vocab):
        monkeypatch.setattr(blocks_module, "_BLOCK_BYTES", 4 * width * block_rows)
        monkeypatch.setattr(blocks_module, "_MANY_VECTORS_BLOCK_BYTES", 4 * width * block_rows)
        head = NearestHead(table, None, "embedding", shared=False)
        assert np.shares_memory(head.table, table)  # read where it is, not copied
        assert head.memory_bytes == table.nbytes
        for metric, scores in (("dot", exact), ("cosine", cosine)):
            want = np.argsort(-scores.astype(np.float32), axis=1, kind="stable")[:, :5]
            alone = [head.search([Query(h[i : i + 1], 5, metric, True, False)])[0]
                     for i in range(len(h))]  # fmt: skip
            (together,) = head.search([Query(h, 5, metric, True, False)])
            ids = np.concatenate([found.ids for found in alone])
            np.testing.assert_array_equal(ids, want)
            np.testing.assert_array_equal(together.ids, want)
            np.testing.assert_array_equal(
                together.scores, np.concatenate([found.scores for found in alone])
            )
            np.testing.assert_array_equal(
                together.scores, np.take_along_axis(scores, want, axis=1).astype(np.float32)
            )
            assert together.logits is not None
            widest = float(np.abs(table.astype(np.float64)).max())
            bound = (width + 4) * 2.0**-24 * 2 * np.abs(h).sum() * widest
            np.testing.assert_allclose(together.logits, exact, rtol=0, atol=bound)
            answers.setdefault(metric, together.ids)
            np.testing.assert_array_equal(answers[metric], together.ids)
    assert NearestHead(table, None, "embedding", shared=True).memory_bytes == 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_narrow_table_of_odd_width(dtype):
    """An odd D has no pairs of bfloat16 words: the block is widened by numpy's cast;
    the answer is still the exact one."""
    import ml_dtypes

    numpy_dtype = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(6)
    table = rng.standard_normal((50, 7)).astype(numpy_dtype)
    h = rng.standard_normal((9, 7)).astype(np.float32)
    (found,) = NearestHead(table, None, "embedding", shared=False).search(
        [Query(h, 3, "dot", False, False)]
    )
    exact = h.astype(np.float64) @ table.astype(np.float64).T
    want = np.argsort(-exact.astype(np.float32), axis=1, kind="stable")[:, :3]
    np.testing.assert_array_equal(found.ids, want)


def test_the_bfloat16_first_pass_misorders_and_the_rescoring_corrects_it():
    """The bfloat16 first pass reads each odd column with its even neighbour's bits below
    it (``head_blocks.Blocks.FIRST_PASS_ERROR``): a row whose neighbours are -1.0 reads
    higher than it is. Row 1 is below row 0 by one unit in its first odd value, but reads
    above it by twelve neighbours' bits: the first pass ranks it first, the answer is row 0
    (and row 0's exact score), and so is the exact widening's when logits are asked."""
    import ml_dtypes

    from tokembed.server.backends.head_blocks import Blocks

    width = 24
    rng = np.random.default_rng(11)
    table = (rng.standard_normal((40, width)) * 0.1).astype(ml_dtypes.bfloat16)
    table[0, 1::2], table[0, 0::2] = 1.0, 0.0
    table[1, 1::2], table[1, 0::2] = 1.0, -1.0
    table[1, 1] = 1.0 - 2.0**-8  # the bfloat16 just below 1.0
    h = np.zeros((1, width), dtype=np.float32)
    h[0, 1::2] = 1.0
    first_pass = Blocks(table).multiply(h, exact=False)
    assert int(first_pass.argmax()) == 1  # misordered, as constructed
    exact = h.astype(np.float64) @ table.astype(np.float64).T
    head = NearestHead(table, None, "embedding", shared=False)
    for logits in (False, True):
        (found,) = head.search([Query(h, 1, "dot", logits, False)])
        assert found.ids.tolist() == [[0]]
        np.testing.assert_array_equal(found.scores, exact[:, [0]].astype(np.float32))
    table[5, 3] = np.inf  # an infinite value would read as a NaN: widened exactly
    assert not NearestHead(table, None, "embedding", shared=False)._blocks.first_pass


@pytest.mark.parametrize("metric", ["dot", "cosine"])
def test_the_bfloat16_first_pass_agrees_with_the_exact_widening(metric):
    """On many near-tied rows (each a random row plus one unit in its last place in one
    value), the answers without logits (the first pass) equal those with (the exact
    widening), ids and scores."""
    import ml_dtypes

    rng = np.random.default_rng(12)
    width = 64
    base = (rng.standard_normal((50, width)) * 0.05).astype(ml_dtypes.bfloat16)
    words = np.repeat(base, 20, axis=0).view(np.uint16).copy()
    columns = rng.integers(0, width, size=len(words))
    words[np.arange(len(words)), columns] += rng.integers(0, 2, size=len(words)).astype(np.uint16)
    table = words.view(ml_dtypes.bfloat16)
    h = (
        np.repeat(base.astype(np.float32), 4, axis=0)
        + rng.standard_normal((200, width)).astype(np.float32) * 0.001
    )
    head = NearestHead(table, None, "embedding", shared=False)
    (fast,) = head.search([Query(h, 5, metric, False, False)])
    (exact,) = head.search([Query(h, 5, metric, True, False)])
    np.testing.assert_array_equal(fast.ids, exact.ids)
    np.testing.assert_array_equal(fast.scores, exact.scores)


def test_a_vector_that_ties_with_every_row_is_rescored_a_slice_at_a_time(monkeypatch):
    """A zero vector scores 0 against every row: every id is a candidate. They are
    re-scored a slice of rows at a time (memory bounded by the slice, not the table), with
    the same answer as in one slice: the lowest ids, score 0."""
    import tracemalloc

    import tokembed.server.backends.head as module

    rng = np.random.default_rng(9)
    table = rng.standard_normal((20000, 128)).astype(np.float32)
    head = NearestHead(table, None, "embedding", shared=False)
    zero = np.zeros((1, 128), dtype=np.float32)
    for metric in ("dot", "cosine"):
        (whole,) = head.search([Query(zero, 3, metric, False, False)])
        monkeypatch.setattr(module, "_RESCORE_BYTES", 8 * 128 * 100)  # 100 rows a slice
        tracemalloc.start()
        (sliced,) = head.search([Query(zero, 3, metric, False, False)])
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        monkeypatch.undo()
        assert sliced.ids.tolist() == whole.ids.tolist() == [[0, 1, 2]]
        np.testing.assert_array_equal(sliced.scores, whole.scores)
        # The candidates' float64 rows at once would be 20000 x 128 x 8 bytes (20 MB).
        assert peak < 4 * 1024 * 1024, peak
