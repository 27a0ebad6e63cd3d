"""The benchmark's request shapes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    seq_len: int
    ragged: bool = False

    def make_ids(self, rng: np.random.Generator, vocab_size: int) -> np.ndarray | list[list[int]]:
        if not self.ragged:
            return rng.integers(0, vocab_size, size=(self.batch, self.seq_len), dtype=np.int64)
        lengths = rng.integers(1, self.seq_len + 1, size=self.batch)
        return [rng.integers(0, vocab_size, size=int(n)).tolist() for n in lengths]

    def tokens(self) -> int:
        """Tokens per request (the mean, for the ragged mix)."""
        return self.batch * (self.seq_len + 1) // 2 if self.ragged else self.batch * self.seq_len

    def output_rows(self) -> int:
        """Rows of the answer: ragged answers are padded to the longest sequence."""
        return self.batch * self.seq_len

    @property
    def shape_text(self) -> str:
        return (
            f"ragged {self.batch}x<={self.seq_len}"
            if self.ragged
            else f"[{self.batch},{self.seq_len}]"
        )


TINY = Workload("tiny", 1, 8)
MEDIUM = Workload("medium", 8, 128)
LARGE = Workload("large", 32, 512)
RAGGED = Workload("ragged", 16, 256, ragged=True)
