"""Text requests as the front ends hand them over (Tokenize, EmbedText, Detokenize), and
what is checked of them before anything is tokenized.

Texts arrive as bytes, so that one which is not UTF-8 reaches validation and is refused
there by its index and the offending byte, not by the transport's parser. A model without
a tokenizer refuses them all, naming how to give it one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tokembed.server.backends.tokenizer import TextTokenizer
from tokembed.server.core.dtypes import OUTPUT_DTYPES, DType
from tokembed.server.core.errors import Internal, InvalidInput, TooLarge
from tokembed.server.core.served import ServedModel

TEXT = "text"  # V2's input of texts (BYTES, [B]); the answers' tensors are named as below
INPUT_IDS = "input_ids"
LENGTHS = "lengths"
OFFSETS = "offsets"
SPECIAL_TOKENS_MASK = "special_tokens_mask"
HIDDEN_STATES = "hidden_states"
TEXTS = "texts"  # V2's output of detokenized texts (BYTES, [B])


class UnreadTexts(ABC):
    """Texts where the request left them, not yet taken (V2: a BYTES input in a
    shared-memory region). What they declare, their count and size, is the request's;
    they are read only once the request fits the model (``read_texts``)."""

    __slots__ = ()

    @property
    @abstractmethod
    def count(self) -> int:
        """The texts the request declares (its input's shape)."""

    @abstractmethod
    async def read(self) -> list[bytes]:
        """The texts, exactly ``count`` of them; raises ``EmbedError``."""


@dataclass(slots=True)
class TextInput:
    """A Tokenize or EmbedText request: texts, how to tokenize them, the answer's dtype
    (EmbedText's), and which of the answer's tensors to send (empty: all)."""

    texts: Sequence[bytes] | UnreadTexts
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


def texts_unread(request: TextInput) -> bool:
    return isinstance(request.texts, UnreadTexts)


async def read_texts(
    request: TextInput, model: ServedModel, known: Sequence[str], output_dtype: bool = False
) -> TextInput:
    """The request with its texts read from where it left them, once what it declares fits
    ``model``: a tokenizer, the outputs asked for among ``known``, the answer's dtype
    (``output_dtype``: EmbedText's) and at least one text. A refused request reads nothing;
    the size read is bounded by the front end (a request's own limit), and the texts'
    tokens, which only tokenizing tells, are checked as for texts in the message."""
    texts = request.texts
    if not isinstance(texts, UnreadTexts):
        return request
    tokenizer_of(model)
    wanted(request.outputs, known)
    if output_dtype:
        answer_dtype(request.output_dtype)
    if texts.count == 0:
        raise InvalidInput("the request has no texts; send at least one (it may be empty)")
    return replace(request, texts=await texts.read())


def answer_dtype(name: str) -> DType:
    """EmbedText's ``output_dtype``, or ``InvalidInput`` naming those it may be."""
    dtype = OUTPUT_DTYPES.get(name)
    if dtype is None:
        *others, last = OUTPUT_DTYPES
        raise InvalidInput(
            f"output_dtype {name} is not supported; ask for {', '.join(others)} or {last}"
        )
    return dtype


def in_hand(texts: Sequence[bytes] | UnreadTexts) -> Sequence[bytes]:
    if isinstance(texts, UnreadTexts):
        raise Internal("this is a bug: texts were validated before they were read")
    return texts


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
