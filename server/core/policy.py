"""Where a look-up runs: on the event loop, on a worker thread, or in a batch.

One decision per request, made here and nowhere else. The engine follows it; every
placement then goes through the same steps (look up, report, answer, encode).

- A backend that gains from company (onnxruntime: a fixed cost per run, a kernel launch
  on CUDA) batches every request. The batcher itself looks a lone small batch up on the
  event loop when it is idle, so a tiny request on a quiet server never waits.
- A table gains nothing from company: a request is looked up on its own, on the event
  loop when it is small (a tiny look-up and encode, ~10 us, cost less than the hop to a
  thread and back), on a worker thread when it is large (its join would hold the loop).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tokembed.server.core.types import Job

# Answers below this are looked up (tables) and encoded on the event loop; larger ones
# on a worker thread. Measured when it was set: a 1 MiB encode takes ~0.1-0.3 ms here,
# about a thread hop's cost.
INLINE_MAX_BYTES = 1 << 20


class Placement(enum.Enum):
    INLINE = "inline"  # on the event loop: the request completes without suspending
    OFF_LOOP = "off_loop"  # on a worker thread, look-up and encode in one hop
    BATCH = "batch"  # in the model's batcher, with whatever else is queued


@dataclass(frozen=True)
class Policy:
    batches: bool  # the backend gains from company
    inline_max_tokens: int  # look-ups of more tokens never run on the event loop
    inline_max_bytes: int = INLINE_MAX_BYTES

    def place(self, job: Job) -> Placement:
        if self.batches:
            return Placement.BATCH
        if self.runs_inline(job.tokens, job.output_bytes):
            return Placement.INLINE
        return Placement.OFF_LOOP

    def runs_inline(self, tokens: int, output_bytes: int) -> bool:
        """Whether a table look-up (and its encode) of this size runs on the event loop."""
        return tokens <= self.inline_max_tokens and output_bytes < self.inline_max_bytes

    def batch_inline_max_tokens(self, row_bytes: int) -> int:
        """The most tokens a batch may hold to be looked up on the event loop (the
        batcher's bound, which counts tokens): as ``runs_inline``, for rows of
        ``row_bytes`` (a batch computes float32 rows)."""
        return min(self.inline_max_tokens, (self.inline_max_bytes - 1) // row_bytes)

    def encodes_inline(self, output_bytes: int) -> bool:
        """Whether a batched answer of this size is encoded on the event loop."""
        return output_bytes < self.inline_max_bytes
