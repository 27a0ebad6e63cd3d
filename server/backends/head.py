"""The way back: vectors to the ids of their nearest rows of the model's output table.

``logits = norm?(h) @ W.T`` in float32 (``W`` widened to float32 once, at load; float32
accumulation for every request dtype), then per vector the ``k`` largest by ``dot``
(the logits themselves) or ``cosine`` (the logits divided by ``|h| |W_v|``; a row of
``W`` with norm 0 scores 0). Equal scores are ordered by the lower id.

The rows of every request in a batch go into one multiply (the table is read once per
batch, a slice of rows at a time so that the ``[rows, V]`` logits stay bounded); each
request then takes its own rows' top-k. It knows nothing of requests or batching: a
``Query`` is a request's vectors, already validated (finite, of width D).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Logits are computed this many bytes ([rows, V] float32) at a time.
_LOGITS_CHUNK_BYTES = 64 * 1024 * 1024

DOT = "dot"
COSINE = "cosine"
METRICS = (DOT, COSINE)


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

    def __init__(self, table: np.ndarray, norm: FinalNorm | None, table_role: str) -> None:
        """``table``: ``W [V, D]`` in its stored dtype (widened to float32 here, once)."""
        self.table = np.ascontiguousarray(table, dtype=np.float32)
        self.vocab_size, self.d_model = self.table.shape
        self.norm = norm
        self.table_role = table_role  # "embedding" (tied) or "output"
        self._row_norms: np.ndarray | None = None

    @property
    def memory_bytes(self) -> int:
        return int(self.table.nbytes)

    def row_norms(self) -> np.ndarray:
        if self._row_norms is None:
            self._row_norms = np.sqrt(np.einsum("vd,vd->v", self.table, self.table))
        return self._row_norms

    def search(self, queries: Sequence[Query]) -> list[Found]:
        """Each query's top-k (and logits), from one multiply over all their rows."""
        rows = [q.vectors if not q.norm else self._normed(q.vectors) for q in queries]
        stacked = rows[0] if len(rows) == 1 else np.concatenate(rows)
        step = max(1, _LOGITS_CHUNK_BYTES // (4 * self.vocab_size))
        results: list[Found] = []
        query_index, start_in_query = 0, 0
        pending: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]] = []
        for start in range(0, len(stacked), step):
            logits = stacked[start : start + step] @ self.table.T
            offset = 0
            while offset < len(logits):
                query = queries[query_index]
                take = min(len(logits) - offset, len(query.vectors) - start_in_query)
                part = logits[offset : offset + take]
                scores = part
                if query.metric == COSINE:
                    h = rows[query_index][start_in_query : start_in_query + take]
                    scores = _cosine(part, h, self.row_norms())
                ids, top = top_k(scores, query.k)
                pending.append((ids, top, part.copy() if query.logits else None))
                offset += take
                start_in_query += take
                if start_in_query == len(query.vectors):
                    results.append(_joined(pending))
                    pending = []
                    query_index += 1
                    start_in_query = 0
        return results

    def _normed(self, vectors: np.ndarray) -> np.ndarray:
        assert self.norm is not None, "This is a bug: validation refuses norm without one."
        return self.norm.apply(vectors)


def _cosine(logits: np.ndarray, h: np.ndarray, row_norms: np.ndarray) -> np.ndarray:
    norms = np.sqrt(np.einsum("nd,nd->n", h, h))[:, None] * row_norms[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        scores = np.where(norms > 0, logits / norms, np.float32(0.0))
    return scores.astype(np.float32, copy=False)


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


def top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest of each row of ``scores [n, V]``: ids int64 ``[n, k]`` and their
    scores, largest first, equal scores by the lower id (also across the k-th place:
    among equal scores there, the lower ids are the ones taken)."""
    n, vocab = scores.shape
    if k < vocab:
        candidates = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        values = np.take_along_axis(scores, candidates, axis=1)
        kth = values.min(axis=1)
        # Rows with more scores equal to the k-th than places left: argpartition took
        # any of them; take the lowest ids among them instead.
        crowded = np.flatnonzero(np.count_nonzero(scores >= kth[:, None], axis=1) > k)
        for row in crowded:
            above = np.flatnonzero(scores[row] > kth[row])
            equal = np.flatnonzero(scores[row] == kth[row])[: k - len(above)]
            candidates[row] = np.concatenate([above, equal])
        values = np.take_along_axis(scores, candidates, axis=1)
    else:
        candidates = np.broadcast_to(np.arange(vocab), (n, vocab)).copy()
        values = scores.copy()
    # By id, then stably by descending score: equal scores keep the lower id first.
    by_id = np.argsort(candidates, axis=1, kind="stable")
    candidates = np.take_along_axis(candidates, by_id, axis=1)
    values = np.take_along_axis(values, by_id, axis=1)
    order = np.argsort(-values, axis=1, kind="stable")
    ids = np.take_along_axis(candidates, order, axis=1).astype(np.int64)
    return ids, np.ascontiguousarray(np.take_along_axis(values, order, axis=1), dtype=np.float32)
