"""The read step (``embed_request.read_inputs``, the operation's ``read``): a request
whose inputs are not read yet (``Unread``: a V2 input's typed contents in its message, or
a shared-memory region) is checked against the model before a byte is read, and reads at
most what its declared shapes need; V2's raw contents are in hand from the start.

A counting source stands in for where the bytes are (a region's read is the registry's
and tests/e2e/test_v2_input_limits.py's, through the real server); the model is the small
one as the server loads it.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from tokembed.server.core.errors import EmbedError, InvalidInput, TooLarge
from tokembed.server.core.operations.embed import EMBED, validate
from tokembed.server.core.operations.embed_request import EmbedInput, IdsInput, Unread
from tokembed.server.core.served import BatchLimits, Limits, ServedModel
from tokembed.server.edge.v2.requests import InferCall, InferParser
from tokembed.server.models.loading import LoadedModel
from tokembed.v2 import grpc_service_pb2 as pb

MAX_TOKENS = 64


class Counted(Unread):
    """Bytes at a source that counts what is read from it; ``declared``: the size the
    request says (None: in the message)."""

    read_bytes = 0

    def __init__(self, data: bytes, declared: int | None) -> None:
        self._data = data
        self._declared = declared

    @property
    def nbytes(self) -> int | None:
        return self._declared

    async def read(self) -> bytes:
        Counted.read_bytes += len(self._data)
        return self._data


@pytest.fixture
def model(small_loaded: LoadedModel) -> ServedModel:
    return ServedModel(
        small_loaded.model, small_loaded.backend, Limits(MAX_TOKENS, 1 << 20),
        BatchLimits(16384, 0.002, 1, 1 << 20),
    )  # fmt: skip


@pytest.fixture(autouse=True)
def counting() -> None:
    Counted.read_bytes = 0


def ids(values: Any, declared: int | str | None = "exact") -> IdsInput:
    array = np.asarray(values, dtype="<i8")
    size = array.nbytes if declared == "exact" else declared
    assert not isinstance(size, str)
    return IdsInput("int64", array.shape, Counted(array.tobytes(), size))


def unread(primary: IdsInput | None, **fields: Any) -> EmbedInput:
    return EmbedInput(
        ids_dtype=primary.dtype if primary else "",
        shape=primary.shape if primary else (),
        data=primary.data if primary else None,
        **fields,
    )


def read(request: EmbedInput, model: ServedModel) -> EmbedInput:
    assert EMBED.unread(request)
    return asyncio.run(EMBED.read(request, model))


BIG = 1 << 21  # what a 2 MiB region would give


def region(size: int) -> IdsInput:
    """An input declaring ``size`` bytes for a shape that needs them (its source holds
    a few: reading it at all is what the tests catch)."""
    return IdsInput("int64", (1, size // 8), Counted(b"\0" * 8, size))


@pytest.mark.parametrize(
    ("request_", "error", "words"),
    [
        # Names the model does not take: refused naming the first, and what it takes.
        (unread(ids([[1, 2]]), more_ids={f"x{i}": region(BIG) for i in range(200)}),
         InvalidInput, "unexpected input 'x0': model 'small' (token kind) takes input_ids"),
        (unread(None, more_ids={"x": ids([[1]])}), InvalidInput, "unexpected input 'x'"),
        (unread(None), InvalidInput, "input input_ids is missing"),
        # A declared size other than what the shape needs; a shape over the limit.
        (unread(ids([[1, 2]], declared=BIG)), InvalidInput,
         "input_ids is declared as 2097152 bytes, but shape [1, 2] of int64 needs 16"),
        # (the size is checked first, as validation does: a shape its bytes do not fill
        # is malformed, however large it claims to be)
        (unread(region(8 << 40)), TooLarge, "over the limit of 64"),
        (unread(replace(ids([[1]]), shape=(1, 1 << 40))), InvalidInput,
         "input_ids is declared as 8 bytes, but shape [1, 1099511627776] of int64 needs"),
        (unread(replace(ids([[1]]), shape=(1, -8))), InvalidInput, "negative dimension"),
        (unread(replace(ids([[1]]), dtype="float32")), InvalidInput, "float32 is not supported"),
        (unread(ids([1, 2, 3]), lengths_input=ids(np.ones(4), declared=32)), InvalidInput,
         "input lengths holds 4 sequences but input_ids only 3 ids"),
        (unread(ids([[1, 2]]), more_ids={"token_type_ids": ids([[0, 0]])}), InvalidInput,
         "unexpected input 'token_type_ids'"),
    ],
)  # fmt: skip
def test_a_refused_request_reads_nothing(
    model: ServedModel, request_: EmbedInput, error: type[EmbedError], words: str
) -> None:
    with pytest.raises(error) as refused:
        read(request_, model)
    assert words in str(refused.value)
    assert Counted.read_bytes == 0


def test_an_accepted_request_reads_what_its_shapes_need_then_validates(
    model: ServedModel,
) -> None:
    sent = unread(ids([3, 4, 5]), lengths_input=ids([1, 2]))
    taken = read(sent, model)
    assert Counted.read_bytes == 3 * 8 + 2 * 8
    assert not EMBED.unread(taken)
    assert taken.lengths == (1, 2) and taken.lengths_input is None
    job = validate(taken, model)
    assert (job.batch, job.seq_len, job.tokens) == (2, 2, 3)


def test_bytes_in_the_message_are_checked_once_taken(model: ServedModel) -> None:
    taken = read(unread(ids([[1, 2, 3]], declared=None)), model)
    assert validate(taken, model).tokens == 3
    short = read(unread(replace(ids([[1, 2, 3]], declared=None), shape=(1, 4))), model)
    with pytest.raises(InvalidInput, match="data is 24 bytes, but shape"):
        validate(short, model)


def test_validating_an_unread_request_is_a_bug_not_a_read(model: ServedModel) -> None:
    with pytest.raises(EmbedError, match="this is a bug"):
        validate(unread(ids([[1, 2]])), model)
    assert Counted.read_bytes == 0


def test_bytes_in_hand_are_checked_before_another_input_is_read(model: ServedModel) -> None:
    # input_ids in hand (V2's raw contents) one id short of its shape, lengths unread:
    # refused by the ids' size before the lengths are read.
    sent = EmbedInput("int64", (3,), np.arange(2, dtype="<i8").tobytes(),
                      lengths_input=ids([1, 2]))  # fmt: skip
    with pytest.raises(InvalidInput, match="input_ids data is 16 bytes, but shape"):
        read(sent, model)
    assert Counted.read_bytes == 0


def v2_request(contents: str, name: str = "input_ids") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="small")
    tensor = request.inputs.add(name=name, datatype="INT64", shape=[1, 3])
    if contents == "raw":
        request.raw_input_contents.append(np.array([1, 2, 3], dtype="<i8").tobytes())
    else:
        tensor.contents.int64_contents.extend([1, 2, 3])
    return request


def test_v2_raw_contents_are_in_hand_and_typed_contents_read_after_the_check(
    model: ServedModel,
) -> None:
    """Raw contents are the message's bytes: the request has nothing left to read, and the
    data plane validates it at once. Typed contents become bytes only once the request's
    declarations fit the model."""
    parse = InferParser(1 << 20, MAX_TOKENS)
    raw = parse(v2_request("raw").SerializeToString())
    assert isinstance(raw, InferCall) and not EMBED.unread(raw.body)
    assert validate(raw.body, model).tokens == 3
    typed = parse(v2_request("typed").SerializeToString())
    assert isinstance(typed, InferCall) and EMBED.unread(typed.body)
    assert validate(read(typed.body, model), model).tokens == 3
    for contents in ("raw", "typed"):
        unknown = parse(v2_request(contents, name="x").SerializeToString())
        assert isinstance(unknown, InferCall)
        with pytest.raises(InvalidInput, match="unexpected input 'x'"):
            if EMBED.unread(unknown.body):
                read(unknown.body, model)
            else:
                validate(unknown.body, model)
