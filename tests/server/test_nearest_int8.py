"""The int8 first pass of ``backends.head`` (``nearest_first_pass = "int8"``): its error
bound holds for every score and prunes the table, and its answers are the exact search's,
id for id, on 10,000 queries of which most are constructed near-ties; then through the
real server and client.

The table holds near-ties of its own: exact duplicates (equal scores, ordered by the lower
id), rows one float32 ulp apart in one component, and a row of zeros. The queries: random
ones; ones just off a row (its duplicates and ulp neighbours then tie with it); and ones
made to score two rows alike (``h . (w_a - w_b) = 0`` in exact arithmetic, both near the
top), so that the first pass's candidates must include both and the rescoring decide.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tokembed.client import EmbeddingClient
from tokembed.export.head import add_head
from tokembed.server.backends.head import NearestHead, Query
from tokembed.server.backends.head_blocks import Blocks, row_norms
from tokembed.server.backends.head_int8 import Int8Table

from support.models import export_model_dir

V, D = 2000, 64
QUERIES = 10_000


def _table() -> np.ndarray:
    rng = np.random.default_rng(31)
    table = rng.standard_normal((V, D)).astype(np.float32)
    table[10:20] = table[0:10]  # duplicates
    nudged = table[30:40].copy()
    nudged[:, 5] = np.nextafter(nudged[:, 5], np.float32(np.inf))
    table[20:30] = nudged  # one ulp from rows 30..39
    table[40] = 0.0
    return table


def _queries(table: np.ndarray) -> np.ndarray:
    rng = np.random.default_rng(32)
    random = rng.standard_normal((4000, D))
    near_rows = rng.choice(np.r_[0:40, 100:200], size=3000)
    just_off = table[near_rows] + 1e-4 * rng.standard_normal((3000, D))
    a, b = rng.integers(0, V, size=(2, 3000))
    b = np.where(a == b, (b + 1) % V, b)
    difference = (table[a] - table[b]).astype(np.float64)
    h = rng.standard_normal((3000, D)) + 3 * (table[a] + table[b])
    along = np.einsum("nd,nd->n", h, difference) / np.maximum(
        np.einsum("nd,nd->n", difference, difference), 1e-30
    )
    alike = h - along[:, None] * difference
    return np.concatenate([random, just_off, alike]).astype(np.float32)


@pytest.fixture(scope="module")
def table() -> np.ndarray:
    return _table()


@pytest.fixture(scope="module")
def queries(table: np.ndarray) -> np.ndarray:
    made = _queries(table)
    assert made.shape == (QUERIES, D)
    return made


def test_the_bound_holds_for_every_score_and_prunes(table, queries) -> None:
    blocks = Blocks(table)
    int8 = Int8Table(blocks, row_norms(blocks), threads=1)
    approx, bounds = int8.first_pass(queries)
    exact = queries.astype(np.float64) @ table.astype(np.float64).T
    assert np.all(np.abs(exact - approx) <= bounds)
    # Not vacuous: the bound is a small part of the spread of a query's scores.
    spread = exact.std(axis=1)
    assert np.median(bounds.max(axis=1) / spread) < 0.1
    assert int8.nbytes == V * D  # a quarter of the float32 table's bytes


@pytest.mark.parametrize("metric", ["dot", "cosine"])
def test_ids_are_the_exact_searchs_on_near_ties(table, queries, metric) -> None:
    exact_head = NearestHead(table, None, "embedding", shared=False)
    int8_head = NearestHead(table, None, "embedding", shared=False, first_pass="int8")
    assert int8_head.first_pass == "int8"
    for k in (1, 5):
        (want,) = exact_head.search([Query(queries, k, metric, False, False)])
        (got,) = int8_head.search([Query(queries, k, metric, False, False)])
        np.testing.assert_array_equal(got.ids, want.ids)
        np.testing.assert_array_equal(got.scores, want.scores)
    # The constructed ties are there: duplicates answered by the lower id.
    (top,) = exact_head.search([Query(table[10:20] * 2, 2, metric, False, False)])
    assert top.ids[:, 0].tolist() == list(range(10))


def test_logits_asked_take_the_float32_pass(table) -> None:
    head = NearestHead(table, None, "embedding", shared=False, first_pass="int8")
    h = np.random.default_rng(3).standard_normal((4, D)).astype(np.float32)
    (found,) = head.search([Query(h, 3, "dot", True, False)])
    assert found.logits is not None
    np.testing.assert_allclose(found.logits, h @ table.T, rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def served_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = export_model_dir(
        tmp_path_factory.mktemp("int8") / "m", vocab_size=V, d_model=D, seed=6, name="m"
    )
    add_head(directory, output_table=None, output_key=None, norm=None)
    return directory


def test_the_server_answers_the_same_with_the_int8_pass(served_model, start_server) -> None:
    h = np.random.default_rng(9).standard_normal((500, D)).astype(np.float32)
    answers = {}
    for first_pass in ("float32", "int8"):
        server = start_server(served_model, nearest_first_pass=first_pass)
        with EmbeddingClient(server.target) as client:
            answers[first_pass] = client.nearest(h, k=4), client.info()
    (float_found, _), (int8_found, info) = answers["float32"], answers["int8"]
    np.testing.assert_array_equal(int8_found.ids, float_found.ids)
    np.testing.assert_array_equal(int8_found.scores, float_found.scores)
    assert info.memory_bytes["float32 head table (mapped)"] == V * D * 4
    assert info.memory_bytes["int8 head table (first pass)"] == V * D
