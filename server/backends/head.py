"""The way back: vectors to the ids of their nearest rows of the model's output table.

``logits = norm?(h) @ W.T`` with float32 accumulation, reading ``W`` as the server holds it
in its stored dtype (never a widened copy of the whole table): a float32 table is
multiplied as it is; a bfloat16 or float16 one a block of rows at a time, each block
widened to float32 (exactly) into a buffer small enough to stay in the cache and
multiplied there, so that the memory traffic is the stored bytes (``Blocks``). Then per
vector the ``k`` largest by ``dot`` (the logits themselves) or ``cosine`` (the logits
divided by ``|h| |W_v|``; a row of ``W`` with norm 0 scores 0). The scores answered are
those products accumulated in float64 and rounded once to float32 (``_exact_top_k``: the
float32 multiply finds the candidates within its proven error bound, which are scored
again), so that a vector's answer is the same alone or in any batch; equal scores are
ordered by the lower id. The logits, when asked, are the float32 multiply's (within
``D 2**-24 |h| |W_v|`` of the exact products): a batch that asks them is multiplied
exactly widened, whatever the table (``Blocks``' bfloat16 first pass is not).

The rows of every request in a batch go into one multiply (the table is read once per
batch, a slice of rows at a time so that the ``[rows, V]`` logits stay bounded); each
request then takes its own rows' top-k. It knows nothing of requests or batching: a
``Query`` is a request's vectors, already validated (finite, of width D).

The multiply is numpy's, or the head graph's in onnxruntime (``HeadGraphRun``:
``head_session.HeadSession``, on the model's execution provider). Through the graph, a
``dot`` query without logits asks its ``TopK`` for more than ``k`` ids (``_wide``): when
the last of them scores below the ``k``-th by more than twice the error bound, every id
that could belong to the exact top-k is among them, and they are the candidates scored
again; otherwise (or for ``cosine``, or logits asked) the row's logits come back whole
and the candidates are found in them as numpy's are. Either way the answer is the exact
one above: the same ids and scores whichever multiply ran. A head made with
``first_pass="int8"`` finds the candidates of a batch without logits in an int8 copy of
the table instead (``Int8Table``: onnxruntime's ``MatMulInteger`` within a proven bound),
with the same answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tokembed.server.backends.head_blocks import ROW_SLICE_BYTES, Blocks, row_norms
from tokembed.server.backends.head_int8 import Int8Table

# Logits are computed this many bytes ([rows, V] float32) at a time, and candidates are
# re-scored this many bytes of float64 rows at a time.
_LOGITS_CHUNK_BYTES = ROW_SLICE_BYTES
_RESCORE_BYTES = ROW_SLICE_BYTES

DOT = "dot"
COSINE = "cosine"
METRICS = (DOT, COSINE)
# How the candidates are found (``NearestHead``'s ``first_pass``).
FLOAT32_PASS = "float32"
INT8_PASS = "int8"
FIRST_PASSES = (FLOAT32_PASS, INT8_PASS)


@dataclass(frozen=True)
class FinalNorm:
    """The model's final norm (``manifest.Norm``'s kind and eps, with its parameters)."""

    kind: str  # "rmsnorm" or "layernorm"
    eps: float
    weight: np.ndarray  # float32 [D]
    bias: np.ndarray | None  # float32 [D]

    def apply(self, h: np.ndarray) -> np.ndarray:
        """As transformers computes it in float32 (``LlamaRMSNorm``, ``nn.LayerNorm``)."""
        eps = np.float32(self.eps)
        if self.kind == "rmsnorm":
            variance = np.mean(h * h, axis=-1, keepdims=True, dtype=np.float32)
            out = h * (np.float32(1.0) / np.sqrt(variance + eps)) * self.weight
        else:
            mean = np.mean(h, axis=-1, keepdims=True, dtype=np.float32)
            centred = h - mean
            variance = np.mean(centred * centred, axis=-1, keepdims=True, dtype=np.float32)
            out = centred / np.sqrt(variance + eps) * self.weight
            if self.bias is not None:
                out = out + self.bias
        return np.ascontiguousarray(out, dtype=np.float32)


@dataclass(slots=True)
class Query:
    """One request's vectors ``[n, D]`` float32, what it asks of them."""

    vectors: np.ndarray
    k: int
    metric: str
    logits: bool  # whether the answer carries the [n, V] logits
    norm: bool  # whether the final norm is applied first


class HeadGraphRun(Protocol):
    """The head graph's multiply and top-k, run elsewhere than numpy (onnxruntime)."""

    provider: str

    def logits(self, h: np.ndarray) -> np.ndarray:
        """float32 ``h [n, D] @ W.T``: ``[n, V]``."""

    def top(self, h: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` largest float32 logits per vector, largest first, and their ids."""


@dataclass(slots=True)
class Found:
    """One request's answer: ids int64 ``[n, k]``, scores float32 ``[n, k]``, and the
    logits float32 ``[n, V]`` when asked."""

    ids: np.ndarray
    scores: np.ndarray
    logits: np.ndarray | None


class NearestHead:
    """A model's output table and final norm, and the search over them (thread-safe:
    nothing changes after load but the row norms, computed once on first cosine use)."""

    def __init__(
        self,
        table: np.ndarray,
        norm: FinalNorm | None,
        table_role: str,
        *,
        shared: bool,
        graph: HeadGraphRun | None = None,
        first_pass: str = FLOAT32_PASS,
        threads: int = 1,
    ) -> None:
        """``table``: ``W [V, D]`` C-contiguous in its stored dtype (float32, float16, or
        bfloat16 as ``ml_dtypes`` holds it), read as it is, never copied. ``shared``: the
        array is one the server already counts (the look-up's own table); otherwise the
        head's bytes are its own (``memory_bytes``). ``graph``: the head graph over the
        same table, which then runs the multiply instead of numpy. ``first_pass``:
        ``"int8"`` finds the candidates of a search without logits in an int8 copy of the
        table made here (``Int8Table``, onnxruntime's ``MatMulInteger`` on ``threads``
        threads) instead of either multiply; the answers are the same."""
        if table.ndim != 2 or not table.flags.c_contiguous:
            raise ValueError("this is a bug: a head table is a C-contiguous [V, D] array")
        self.table = table
        self.vocab_size, self.d_model = table.shape
        self.norm = norm
        self.table_role = table_role  # "embedding" (tied) or "output"
        self.shared = shared
        self._blocks = Blocks(table)
        self._row_norms64 = row_norms(self._blocks)
        # The bfloat16 first pass's bound holds for finite rows only (an infinite value's
        # word would read as a NaN): a table with one is widened exactly.
        self._blocks.first_pass = self._blocks.first_pass and bool(
            np.isfinite(self._row_norms64).all()
        )
        self._widest = float(self._row_norms64.max()) if self.vocab_size else 0.0
        self._inverse_norms: np.ndarray | None = None
        self._graph = graph
        # What runs the multiply: "numpy", or the graph's onnxruntime provider.
        self.runs_on = "numpy" if graph is None else graph.provider
        if first_pass not in FIRST_PASSES:
            raise ValueError(f"this is a bug: first pass {first_pass!r}")
        self._int8 = (
            Int8Table(self._blocks, self._row_norms64, threads) if first_pass == INT8_PASS else None
        )

    @property
    def first_pass(self) -> str:
        return FLOAT32_PASS if self._int8 is None else INT8_PASS

    @property
    def int8_bytes(self) -> int:
        """The int8 copy's bytes (0 without one), resident beside ``memory_bytes``: the
        codes (onnxruntime may keep a packed copy of its own, not counted here)."""
        return 0 if self._int8 is None else self._int8.nbytes

    @property
    def memory_bytes(self) -> int:
        """The bytes the head holds beside what the look-up holds: 0 when it reads the
        look-up's table."""
        return 0 if self.shared else int(self.table.nbytes)

    @property
    def stored_dtype(self) -> str:
        return str(self.table.dtype)

    def inverse_norms(self) -> np.ndarray:
        """float32 ``1 / |W_v|`` (0 for a row of norm 0), for the first pass of cosine."""
        if self._inverse_norms is None:
            norms = self._row_norms64
            inverse = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
            self._inverse_norms = inverse.astype(np.float32)
        return self._inverse_norms

    def search(self, queries: Sequence[Query]) -> list[Found]:
        """Each query's top-k (and logits), from one multiply over all their rows (the
        int8 first pass when the head has one and no query asks for the logits, which
        are a float32 multiply's)."""
        rows = [q.vectors if not q.norm else self._normed(q.vectors) for q in queries]
        stacked = rows[0] if len(rows) == 1 else np.concatenate(rows)
        # Logits answered are the exact widening's; a batch that asks none takes the
        # faster first pass, whose wider bound the re-scoring covers (numpy's: the graph
        # widens exactly).
        exact = (
            self._graph is not None or any(q.logits for q in queries)
            or not self._blocks.first_pass
        )  # fmt: skip
        int8 = None if any(q.logits for q in queries) else self._int8
        step = max(1, _LOGITS_CHUNK_BYTES // (4 * self.vocab_size))
        if int8 is not None:
            step = max(1, _LOGITS_CHUNK_BYTES // (8 * self.vocab_size))
        results: list[Found] = []
        query_index, start_in_query = 0, 0
        pending: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]] = []
        for start in range(0, len(stacked), step):
            chunk = stacked[start : start + step]
            spans = _spans(queries, query_index, start_in_query, len(chunk))
            first: np.ndarray | tuple[np.ndarray, np.ndarray]
            bounds = None
            if int8 is not None:
                first, bounds = int8.first_pass(chunk)
            else:
                first = self._first_pass(chunk, [queries[index] for index, _ in spans], exact)
            offset = 0
            for index, take in spans:
                query = queries[index]
                h = rows[index][start_in_query : start_in_query + take]
                if bounds is not None:  # the int8 pass's scores and their bounds
                    assert not isinstance(first, tuple), "This is a bug."
                    ids, top = self._bounded_top_k(
                        first[offset : offset + take], bounds[offset : offset + take], h,
                        query.k, query.metric,
                    )  # fmt: skip
                    pending.append((ids, top, None))
                elif isinstance(first, tuple):  # the graph's widened top-k: candidates
                    wide_scores, wide_ids = first
                    ids, top = self._exact_top_k_of(
                        wide_scores[offset : offset + take], wide_ids[offset : offset + take],
                        h, query.k,
                    )  # fmt: skip
                    pending.append((ids, top, None))
                else:
                    part = first[offset : offset + take]
                    ids, top = self._exact_top_k(part, h, query.k, query.metric, exact=exact)
                    pending.append((ids, top, part.copy() if query.logits else None))
                offset += take
                start_in_query += take
                if start_in_query == len(query.vectors):
                    results.append(_joined(pending))
                    pending = []
                    query_index += 1
                    start_in_query = 0
        return results

    def _first_pass(
        self, chunk: np.ndarray, queries: Sequence[Query], exact: bool
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """The chunk's float32 logits (numpy's: ``exact`` as ``Blocks.multiply`` takes
        it), or (through the graph, when every query in it is ``dot`` without logits) its
        widened top-k: scores and ids ``[rows, _wide(k)]``."""
        graph = self._graph
        if graph is None:
            return self._blocks.multiply(chunk, exact=exact)
        if all(q.metric == DOT and not q.logits for q in queries):
            wide = min(self.vocab_size, max(_wide(q.k) for q in queries))
            return graph.top(chunk, wide)
        return graph.logits(chunk)

    def _exact_top_k_of(
        self, wide_scores: np.ndarray, wide_ids: np.ndarray, h: np.ndarray, k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """``dot``'s exact top-k from the graph's widened top-k (float32 scores, largest
        first, and their ids): every id whose float32 score is within twice the error
        bound of the ``k``-th is a candidate, as in ``_exact_top_k``. The widened list
        holds them all when its last score is below that line (an id left out scores at
        most that); a row where it is not (or could not be: the list is every id) has
        its logits computed whole instead."""
        h_norms = np.sqrt(np.einsum("nd,nd->n", h.astype(np.float64), h.astype(np.float64)))
        bound = self._gamma() * h_norms * self._widest
        ids = np.empty((len(h), k), dtype=np.int64)
        top = np.empty((len(h), k), dtype=np.float32)
        complete = wide_scores.shape[1] == self.vocab_size
        for row in range(len(h)):
            line = wide_scores[row, k - 1] - 2 * bound[row]
            if not complete and not wide_scores[row, -1] < line:
                assert self._graph is not None, "This is a bug: a widened top-k is the graph's."
                one = h[row : row + 1]
                logits = self._graph.logits(one)
                found_ids, found_top = self._exact_top_k(logits, one, k, DOT, exact=True)
                ids[row], top[row] = found_ids[0], found_top[0]
                continue
            candidates = np.sort(wide_ids[row][wide_scores[row] >= line].astype(np.int64))
            ids[row], top[row] = self._rescored(candidates, h[row], h_norms[row], k, DOT)
        return ids, top

    def _gamma(self) -> float:
        """The relative error bound of a float32 dot product over D terms, with room."""
        return float((self.d_model + 4) * 2.0**-24 * 1.01)

    def _exact_top_k(
        self, logits: np.ndarray, h: np.ndarray, k: int, metric: str, *, exact: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """The top-k by scores accumulated in float64 and rounded once to float32, found
        through the float32 multiply: every id whose float32 score is within twice its
        error bound of the k-th is a candidate, and the candidates are scored again.

        A float32 dot product over D terms differs from the exact one by at most
        ``D 2**-24 sum|h_i w_i|`` whatever the order of its sums (which BLAS chooses by
        the batch's shape), and ``sum|h_i w_i| <= |h| |w|``: ``bound`` is that, for the
        widest row of the table (cosine, ranked by ``cosine |h|``: divided by ``|w_v|``,
        at most ``D 2**-24 |h|``, plus the roundings of the division).
        So the answer is the same whatever the batch a vector was in, and whatever BLAS.

        ``logits`` from ``Blocks``' first pass (``exact`` false) are of values off by
        ``|delta_i| <= rel |w_i| + a`` each (``Blocks.FIRST_PASS_ERROR``), which adds
        ``sum|h_i delta_i| <= rel |h| |w| + a sqrt(D) |h|`` to the error, and widens the
        terms the float32 sums round by ``(1 + rel)``.
        """
        h_norms = np.sqrt(np.einsum("nd,nd->n", h.astype(np.float64), h.astype(np.float64)))
        rel, per_value = (0.0, 0.0) if exact else Blocks.FIRST_PASS_ERROR
        gamma = self._gamma() * (1 + rel) + rel
        absolute = (1 + gamma) * per_value * np.sqrt(self.d_model)
        if metric == COSINE:
            # The first pass ranks by ``cosine |h|`` (``|h|`` is the same along a row, so
            # the order is cosine's): one multiply of the logits by ``1 / |W_v|``, whose
            # error is the logits' divided by ``|W_v|``, at most ``gamma |h|``, plus the
            # roundings of ``1 / |W_v|`` and of the product (each ``2**-24`` of a score of
            # at most ``|h|``): inside ``2**-21 |h|``.
            inverse = self.inverse_norms()
            scores = np.multiply(logits, inverse)
            widest_inverse = float(inverse.max()) if len(inverse) else 0.0
            bound = (gamma + 2.0**-21 * (1 + rel) + absolute * widest_inverse) * h_norms
        else:
            scores = logits
            bound = (gamma * self._widest + absolute) * h_norms
        ids = np.empty((len(h), k), dtype=np.int64)
        top = np.empty((len(h), k), dtype=np.float32)
        kth = _kth_largest(scores, k)
        for row in range(len(h)):
            candidates = np.flatnonzero(scores[row] >= kth[row] - 2 * bound[row])
            ids[row], top[row] = self._rescored(candidates, h[row], h_norms[row], k, metric)
        return ids, top

    def _bounded_top_k(
        self, approx: np.ndarray, bounds: np.ndarray, h: np.ndarray, k: int, metric: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """The same top-k as ``_exact_top_k``, from the int8 first pass: ``approx [n, V]``
        float64 scores, each within ``bounds [n, V]`` of ``h . w_v`` (``Int8Table``).

        With ``lower = approx - bounds`` and ``upper = approx + bounds``, the k-th largest
        exact score lies in ``[L, U]``, the k-th largest of ``lower`` and of ``upper``. An id
        whose ``upper`` is below ``L - 2**-22 max(|L|, |U|)`` scores less than the k-th by
        more than the float32 rounding of the answer (at most ``2**-23`` of it) can close,
        so it is not in the answer, not even as an equal score taken by its lower id:
        every other id is a candidate, rescored as ``_exact_top_k``'s are. Cosine ranks by
        ``score / |w_v|`` (the same order as cosine, for a given ``h``), bounds divided
        alike; float64 rounding is far inside the margin.
        """
        h_norms = np.sqrt(np.einsum("nd,nd->n", h.astype(np.float64), h.astype(np.float64)))
        if metric == COSINE:
            inverse = np.divide(
                1.0, self._row_norms64, out=np.zeros_like(self._row_norms64),
                where=self._row_norms64 > 0,
            )  # fmt: skip
            approx = approx * inverse
            bounds = bounds * inverse
        lower = _kth_largest(approx - bounds, k)
        upper = _kth_largest(approx + bounds, k)
        margin = 2.0**-22 * np.maximum(np.abs(lower), np.abs(upper))
        ids = np.empty((len(h), k), dtype=np.int64)
        top = np.empty((len(h), k), dtype=np.float32)
        for row in range(len(h)):
            reach = approx[row] + bounds[row]
            candidates = np.flatnonzero(reach >= lower[row] - margin[row])
            ids[row], top[row] = self._rescored(candidates, h[row], h_norms[row], k, metric)
        return ids, top

    def _rescored(
        self, candidates: np.ndarray, h: np.ndarray, h_norm: float, k: int, metric: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """The top ``k`` of ``candidates`` (ascending ids) by their exact scores: each
        row's products with ``h`` in float64 (exact: float32 by float32), summed by numpy's
        pairwise sum over the row (an order fixed by D alone, so a row's score is the same
        whichever candidates come with it), rounded once to float32; equal scores by the
        lower id."""
        h64 = h.astype(np.float64)
        exact = np.empty(len(candidates), dtype=np.float64)
        # A slice of rows at a time: a vector that ties with every row (zeros) makes every
        # id a candidate, whose float64 rows at once would be twice the table's size.
        step = max(1, _RESCORE_BYTES // (8 * max(1, self.d_model)))
        for start in range(0, len(candidates), step):
            rows = self._blocks.rows64(candidates[start : start + step])
            exact[start : start + len(rows)] = (rows * h64).sum(axis=1)
        if metric == COSINE:
            norms = h_norm * self._row_norms64[candidates]
            exact = np.divide(exact, norms, out=np.zeros_like(exact), where=norms > 0)
        rounded = exact.astype(np.float32)
        # Largest first; equal (rounded) scores by the lower id (candidates ascend).
        order = np.argsort(-rounded, kind="stable")[:k]
        return candidates[order], rounded[order]

    def _normed(self, vectors: np.ndarray) -> np.ndarray:
        assert self.norm is not None, "This is a bug: validation refuses norm without one."
        return self.norm.apply(vectors)


def _wide(k: int) -> int:
    """How many ids to ask the graph's TopK for, to find ``k`` exactly: room for the near
    ties within the error bound (a row without enough room has its logits computed)."""
    return 2 * k + 32


def _spans(
    queries: Sequence[Query], index: int, start_in_query: int, rows: int
) -> list[tuple[int, int]]:
    """The queries a chunk of ``rows`` stacked rows holds, from query ``index`` row
    ``start_in_query`` on: each one's index and how many of its rows."""
    spans = []
    while rows:
        take = min(rows, len(queries[index].vectors) - start_in_query)
        spans.append((index, take))
        rows -= take
        index, start_in_query = index + 1, 0
    return spans


def _kth_largest(scores: np.ndarray, k: int) -> np.ndarray:
    vocab = scores.shape[1]
    if k == 1:  # a reduction, far cheaper than a partition
        return np.asarray(scores.max(axis=1))
    if k >= vocab:
        return np.asarray(scores.min(axis=1))
    return np.asarray(np.partition(scores, vocab - k, axis=1)[:, vocab - k])


def _joined(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]) -> Found:
    if len(parts) == 1:
        ids, scores, logits = parts[0]
        return Found(ids, scores, logits)
    logits_parts = [p[2] for p in parts]
    return Found(
        np.concatenate([p[0] for p in parts]),
        np.concatenate([p[1] for p in parts]),
        None if logits_parts[0] is None else np.concatenate(logits_parts),  # type: ignore[arg-type]
    )
