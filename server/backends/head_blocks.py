"""How the head reads its table: in the stored dtype, a block of rows at a time
(``Blocks``), and the rows' norms (``row_norms``). ``head`` searches over them."""

from __future__ import annotations

import numpy as np

# Rows are read (their norms, their float64 copies) this many bytes at a time.
ROW_SLICE_BYTES = 64 * 1024 * 1024
# A narrow table is widened this many float32 bytes of rows at a time: small enough that
# the widened block is still in the cache when the multiply reads it. That is what counts
# for a few vectors, whose multiply is bound by memory; from ``_MANY_VECTORS`` on it is
# bound by arithmetic, and fewer, larger multiplies count more (each is a BLAS call whose
# threads meet once: on a busy machine, each of many small ones waited for a core).
_BLOCK_BYTES = 2 * 1024 * 1024
_MANY_VECTORS = 16
_MANY_VECTORS_BLOCK_BYTES = 32 * 1024 * 1024


class Blocks:
    """A ``[V, D]`` table read in its stored dtype, widened to float32 a block at a time.

    bfloat16 is the upper half of a float32: the table's bytes seen as ``uint32`` pairs
    ``(w[2j+1] << 16) | w[2j]`` give ``w[2j]`` exactly by a shift left by 16 and
    ``w[2j+1]`` exactly by masking off the low half, two word-wide passes over a block in
    the cache (where a cast from 16-bit to 32-bit words measured an order slower). So a
    bfloat16 block's product is that of the even columns plus that of the odd columns:
    still float32 sums of the same ``D`` products, inside ``_exact_top_k``'s bound.

    The first pass (``exact`` false) skips the mask: it multiplies the odd columns by the
    words as they are, the float32 whose upper half is ``w[2j+1]`` and whose lower half is
    ``w[2j]``'s bits. That value exceeds ``w[2j+1]`` in magnitude by less than one unit in
    the last place of a bfloat16, less than ``2**-7 |w[2j+1]|`` (by less than ``2**-133``
    where ``w[2j+1]`` is zero or subnormal): ``FIRST_PASS_ERROR``, which the re-scoring's
    bound adds. The multiply then reads the table straight from memory for half of its
    columns and writes only the even half, and the candidates it finds are scored again
    exactly. float16 is widened by numpy's cast; float32 is multiplied as it is.
    """

    # (relative, absolute) error of each value the bfloat16 first pass reads.
    FIRST_PASS_ERROR = (2.0**-7, 2.0**-133)

    def __init__(self, table: np.ndarray) -> None:
        self.table = table
        d_model = table.shape[1]
        self._kind = "float32"
        if table.dtype != np.float32:
            self._kind = "float16" if table.dtype == np.float16 else "bfloat16"
            if self._kind == "bfloat16" and (table.dtype.itemsize != 2 or d_model % 2):
                self._kind = "cast"  # an odd D: no word pairs; numpy's (slower) cast
        self._words = table.view(np.uint32) if self._kind == "bfloat16" else None
        # Whether ``multiply(exact=False)`` may take the first pass (its owner may say no).
        self.first_pass = self._kind == "bfloat16"

    def multiply(self, h: np.ndarray, *, exact: bool = True) -> np.ndarray:
        """``h [n, D] float32 @ W.T``: float32 ``[n, V]``; with ``exact`` false, a
        bfloat16 table's first pass (``FIRST_PASS_ERROR``)."""
        if self._kind == "float32":
            return np.asarray(h @ self.table.T, dtype=np.float32)
        vocab = len(self.table)
        out = np.empty((len(h), vocab), dtype=np.float32)
        step = self._rows_per_block(len(h))
        if self._kind == "bfloat16":
            words = self._words
            assert words is not None
            even_h = np.ascontiguousarray(h[:, 0::2])
            odd_h = np.ascontiguousarray(h[:, 1::2])
            if not exact and self.first_pass:
                return self._first_pass(words, even_h, odd_h, out)
            low = np.empty((step, words.shape[1]), dtype=np.uint32)
            high = np.empty((step, words.shape[1]), dtype=np.uint32)
            odd = np.empty((len(h), step), dtype=np.float32)
            shift, mask = np.uint32(16), np.uint32(0xFFFF0000)
            for start in range(0, vocab, step):
                block = words[start : start + step]
                n = len(block)
                np.left_shift(block, shift, out=low[:n])
                np.bitwise_and(block, mask, out=high[:n])
                part = out[:, start : start + n]
                np.matmul(even_h, low[:n].view(np.float32).T, out=part)
                np.matmul(odd_h, high[:n].view(np.float32).T, out=odd[:, :n])
                part += odd[:, :n]
            return out
        widened = np.empty((step, self.table.shape[1]), dtype=np.float32)
        for start in range(0, vocab, step):
            block = self.table[start : start + step]
            n = len(block)
            np.copyto(widened[:n], block, casting="unsafe")
            np.matmul(h, widened[:n].T, out=out[:, start : start + n])
        return out

    def _first_pass(
        self, words: np.ndarray, even_h: np.ndarray, odd_h: np.ndarray, out: np.ndarray
    ) -> np.ndarray:
        step = self._rows_per_block(len(even_h))
        low = np.empty((step, words.shape[1]), dtype=np.uint32)
        even = np.empty((len(even_h), step), dtype=np.float32)
        for start in range(0, len(words), step):
            block = words[start : start + step]
            n = len(block)
            part = out[:, start : start + n]
            np.matmul(odd_h, block.view(np.float32).T, out=part)  # reads the block in
            np.left_shift(block, np.uint32(16), out=low[:n])  # from the cache
            np.matmul(even_h, low[:n].view(np.float32).T, out=even[:, :n])
            part += even[:, :n]
        return out

    def _rows_per_block(self, vectors: int) -> int:
        block = _BLOCK_BYTES if vectors < _MANY_VECTORS else _MANY_VECTORS_BLOCK_BYTES
        return max(1, block // (4 * max(1, int(self.table.shape[1]))))

    def rows64(self, ids: np.ndarray) -> np.ndarray:
        """The rows ``ids`` in float64 (exact for every stored dtype)."""
        return np.asarray(self.table[ids], dtype=np.float64)


def row_norms(blocks: Blocks) -> np.ndarray:
    """Each row's norm in float64, a slice of rows at a time (no float64 copy of the table)."""
    table = blocks.table
    norms = np.empty(len(table), dtype=np.float64)
    step = max(1, ROW_SLICE_BYTES // (8 * max(1, table.shape[1])))
    for start in range(0, len(table), step):
        rows = np.asarray(table[start : start + step], dtype=np.float64)
        norms[start : start + step] = np.sqrt(np.einsum("vd,vd->v", rows, rows))
    return norms
