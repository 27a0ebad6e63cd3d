"""Text requests as the front ends hand them over (Tokenize, EmbedText, Detokenize), and
what is checked of them before anything is tokenized.

Texts arrive as bytes, so that one which is not UTF-8 reaches validation and is refused
there by its index and the offending byte, not by the transport's parser. A model without
a tokenizer refuses them all, naming how to give it one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokembed.server.backends.tokenizer import TextTokenizer
from tokembed.server.core.errors import InvalidInput, TooLarge
from tokembed.server.core.served import ServedModel

TEXT = "text"  # V2's input of texts (BYTES, [B]); the answers' tensors are named as below
INPUT_IDS = "input_ids"
LENGTHS = "lengths"
OFFSETS = "offsets"
SPECIAL_TOKENS_MASK = "special_tokens_mask"
HIDDEN_STATES = "hidden_states"


@dataclass(slots=True)
class TextInput:
    """A Tokenize or EmbedText request: texts, how to tokenize them, the answer's dtype
    (EmbedText's), and which of the answer's tensors to send (empty: all)."""

    texts: Sequence[bytes]
    add_special_tokens: bool = True
    truncate: bool = False  # False: a text over the model's limit is refused
    output_dtype: str = "float32"
    outputs: tuple[str, ...] = ()


@dataclass(slots=True)
class DetokenizeInput:
    """A Detokenize request: ``ids`` (int64 or int32 bytes) of ``lengths`` sequences."""

    ids_dtype: str
    shape: tuple[int, ...]
    data: bytes
    lengths: tuple[int, ...] = ()
    skip_special_tokens: bool = False


def tokenizer_of(model: ServedModel) -> TextTokenizer:
    if model.tokenizer is None:
        raise InvalidInput(
            f"model {model.name!r} has no tokenizer: text needs one exported with the model "
            "(tokembed export ... --tokenizer tokenizer.json); send ids to Embed instead"
        )
    return model.tokenizer


def decoded_texts(texts: Sequence[bytes]) -> list[str]:
    """The texts as str; raises ``InvalidInput`` naming the first that is not UTF-8."""
    if not texts:
        raise InvalidInput("the request has no texts; send at least one (it may be empty)")
    decoded = []
    for index, text in enumerate(texts):
        try:
            decoded.append(text.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise InvalidInput(
                f"texts[{index}] is not valid UTF-8: byte {text[exc.start]:#04x} at offset "
                f"{exc.start} ({exc.reason})"
            ) from None
    return decoded


def estimated_tokens(texts: Sequence[bytes], max_length: int, truncate: bool) -> int:
    """What admission counts before tokenizing: a token of these tokenizers covers at least
    one byte of text, bar the few special tokens added around it."""
    per_text = (len(text) + 2 for text in texts)
    return sum(min(count, max_length) if truncate else count for count in per_text)


def check_lengths(lengths: Sequence[int], tokenizer: TextTokenizer, model: ServedModel) -> int:
    """The tokens of a tokenized request, within the model's limit per text and the
    request's limit; raises ``TooLarge`` naming the first text over it."""
    limit = tokenizer.max_length
    for index, length in enumerate(lengths):
        if length > limit:
            raise TooLarge(
                f"texts[{index}] is {length} tokens, over the model's limit of {limit}; "
                "shorten it, or ask for truncation"
            )
    total = int(sum(lengths))
    request_limit = model.limits.max_tokens_per_request
    if total > request_limit:
        raise TooLarge(
            f"the texts are {total} tokens, over the limit of {request_limit} per request; "
            "split them"
        )
    return total


def wanted(outputs: tuple[str, ...], known: Sequence[str]) -> tuple[str, ...]:
    """The answer's tensors a request asks for, in ``known``'s order (none named: all)."""
    for name in outputs:
        if name not in known:
            raise InvalidInput(f"unexpected output {name!r}; this answer has {', '.join(known)}")
    return tuple(name for name in known if not outputs or name in outputs)
