"""Where a compute runs: on the event loop, on a worker thread, or in a batch.

Every placement is decided here and nowhere else; the scheduler follows it, and every
placement then goes through the same steps (compute, report, answer, frame).

- A backend that gains from company (onnxruntime: a fixed cost per run, a kernel launch
  on CUDA) batches a request, unless its batcher is idle and the request small: then it
  is a batch of one computed right here, so a tiny request on a quiet server never waits
  (no queue, no task, no thread hop: on an idle server these cost more than the look-up).
  A batch the batcher forms is computed on the event loop when it is small, else on a
  worker thread (``runs_inline``, asked per batch).
- An operation that tokenizes text (``Operation.off_loop``) always runs on a worker
  thread, alone: what a tokenizer costs is not known before it runs, and its request's
  texts are the library's own batch.
- A table gains nothing from company: a request is computed on its own, on the event
  loop when it is small (a tiny look-up and frame cost less than the hop to a thread and
  back), on a worker thread when it is large (its join would hold the loop).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# Answers below this are computed (tables) and framed on the event loop; larger ones on a
# worker thread: around this size, an encode costs about what a hop to a thread does.
INLINE_MAX_BYTES = 1 << 20


class Placement(enum.Enum):
    INLINE = "inline"  # on the event loop: the request completes without suspending
    OFF_LOOP = "off_loop"  # on a worker thread, compute and frame in one hop
    BATCH = "batch"  # in the model's batcher, with whatever else is queued


@dataclass(frozen=True)
class Policy:
    batches: bool  # the backend gains from company
    inline_max_tokens: int  # computes of more tokens never run on the event loop
    inline_max_bytes: int = INLINE_MAX_BYTES

    def place(
        self,
        tokens: int,
        output_bytes: int,
        *,
        batcher_idle: bool,
        heavy: bool = False,
        off_loop: bool = False,
    ) -> Placement:
        """Where one request's compute runs (``batcher_idle``: nothing queued or
        computing in the batcher it would join; ``heavy``: an operation whose compute
        reads a whole table, which always batches, whatever the backend; ``off_loop``: an
        operation whose compute never runs on the loop nor in a batch, a tokenizer's)."""
        if heavy:
            return Placement.BATCH
        if off_loop:
            return Placement.OFF_LOOP
        if self.runs_inline(tokens, output_bytes) and (batcher_idle or not self.batches):
            return Placement.INLINE
        return Placement.BATCH if self.batches else Placement.OFF_LOOP

    def runs_inline(self, tokens: int, output_bytes: int, *, heavy: bool = False) -> bool:
        """Whether a compute of this size (one request's, or a batch's) runs on the event
        loop (a heavy one never does)."""
        return (
            not heavy and tokens <= self.inline_max_tokens and output_bytes < self.inline_max_bytes
        )

    def frames_inline(self, output_bytes: int) -> bool:
        """Whether an answer of this size computed in a batch is framed on the event loop."""
        return output_bytes < self.inline_max_bytes
