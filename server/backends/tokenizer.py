"""A model's own tokenizer: texts -> ids (with offsets and which are special), ids -> texts.

It holds the ``tokenizers`` library's ``Tokenizer`` loaded from the model directory's
``tokenizer.json``, twice: as it is, and with truncation at the model's limit. Neither is
changed after load (a ``Tokenizer``'s truncation and padding are settings of the object,
so a request that set them would change them under every other request); padding is
switched off in both, since answers are ragged (ids with their lengths). A batch of texts
is one ``encode_batch`` (the library encodes it on its own threads, without the GIL).
Those threads are one fewer than the cores (``RAYON_NUM_THREADS``, the library's own knob,
unless the operator set it): with every core encoding, the event loop waited for a core
and tiny requests for tens of milliseconds (tests/e2e/test_text_off_loop.py).

Blocking and thread-safe: the scheduler calls it on worker threads, several at once.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tokembed.server.core.dtypes import INT64

if TYPE_CHECKING:
    from tokenizers import Tokenizer


@dataclass(slots=True)
class Encoded:
    """A batch of texts, tokenized: every text's ids one after another (``ids [N]``), with
    ``lengths [B]``, each token's ``offsets [N, 2]`` (characters of its text: start, end)
    and ``special [N]`` (1 for a token the tokenizer added: [CLS], </s>...)."""

    ids: np.ndarray
    lengths: np.ndarray
    offsets: np.ndarray | None  # None: not asked for
    special: np.ndarray | None


class TextTokenizer:
    def __init__(self, path: Path, max_length: int) -> None:
        """``max_length``: the longest text in tokens the model takes (truncation's)."""
        # Before the library's first batch, which builds its thread pool.
        os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, (os.cpu_count() or 1) - 1)))
        # Imported here: a server none of whose models has a tokenizer never loads it.
        from tokenizers import Tokenizer

        self.path = path
        self.max_length = max_length
        plain = Tokenizer.from_file(str(path))
        plain.no_padding()
        plain.no_truncation()
        truncating = Tokenizer.from_str(plain.to_str())
        truncating.enable_truncation(max_length)
        self._plain: Tokenizer = plain
        self._truncating: Tokenizer = truncating
        self.vocab_size = plain.get_vocab_size(with_added_tokens=True)

    def encode(
        self,
        texts: Sequence[str],
        *,
        add_special_tokens: bool,
        truncate: bool,
        details: bool = True,
    ) -> Encoded:
        """``details``: with each token's offsets and special mark (else ids alone: what
        a look-up needs, for a third of the work of reading the encodings)."""
        tokenizer = self._truncating if truncate else self._plain
        encodings = tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        per_text = [encoding.ids for encoding in encodings]
        lengths = np.fromiter(map(len, per_text), INT64.numpy, len(per_text))
        ids = np.fromiter(itertools.chain.from_iterable(per_text), INT64.numpy, int(lengths.sum()))
        if not details:
            return Encoded(ids, lengths, None, None)
        offsets = np.array(
            [pair for encoding in encodings for pair in encoding.offsets], INT64.numpy
        ).reshape(len(ids), 2)
        special = np.fromiter(
            itertools.chain.from_iterable(e.special_tokens_mask for e in encodings),
            np.int32, len(ids),
        )  # fmt: skip
        return Encoded(ids, lengths, offsets, special)

    def decode(self, sequences: Sequence[Sequence[int]], *, skip_special_tokens: bool) -> list[str]:
        return self._plain.decode_batch(
            [list(ids) for ids in sequences], skip_special_tokens=skip_special_tokens
        )
