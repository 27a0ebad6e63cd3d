"""EmbedStream through EmbeddingClient against the real server: answers in order and by
value, and each failed item's typed error, chosen by the reason the server gives it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from client_support import (
    HeldServer,
    client_for,
    requests_of,
)

from tokembed.client import (
    EmbeddingError,
    EmbedResult,
    InvalidInputError,
    OverloadedError,
    RequestTooLargeError,
    UnavailableError,
)

from support.fixtures import SMALL_PAD, SMALL_V
from support.models import padded
from support.ports import free_port
from support.server import ServerThread

SC = grpc.StatusCode
Start = Callable[..., ServerThread]


def test_stream_answers_in_order(real_server: ServerThread, small_rows: np.ndarray) -> None:
    inputs = [[[1, 2]], [[3]], [[4, 5], [6]], np.array([7, 8, 9], np.int32)]
    with client_for(real_server) as client:
        out = list(client.embed_stream(inputs))
    assert len(out) == 4
    np.testing.assert_array_equal(out[0], small_rows[[[1, 2]]])
    np.testing.assert_array_equal(out[1], small_rows[[[3]]])
    np.testing.assert_array_equal(out[2], padded(small_rows, [[4, 5], [6]], small_rows[SMALL_PAD]))
    np.testing.assert_array_equal(out[3], small_rows[[[7, 8, 9]]])  # one sequence: [1, S]
    assert requests_of(real_server, "EmbedStream") == 4  # one stream, four requests


def test_stream_error_raises_for_its_item(
    real_server: ServerThread, small_rows: np.ndarray
) -> None:
    inputs = [[[1]], [[2]], [[SMALL_V]], [[4]]]
    got: list[np.ndarray] = []
    with (
        client_for(real_server) as client,
        pytest.raises(InvalidInputError, match=r"input_ids\[0,0\] = 1000 is outside") as info,
    ):
        for hs in client.embed_stream(inputs):
            got.append(hs)
    assert len(got) == 2
    np.testing.assert_array_equal(np.concatenate(got), small_rows[[[1], [2]]])
    assert (info.value.code, info.value.reason) == (SC.INVALID_ARGUMENT, "invalid_input")


def test_stream_return_exceptions_keeps_going(
    real_server: ServerThread, small_rows: np.ndarray
) -> None:
    inputs = [[[1]], [[SMALL_V]], [[1.5]], [[4]]]  # a server refusal, then a client refusal
    with client_for(real_server) as client:
        out = list(client.embed_stream_results(inputs, return_exceptions=True))
    assert [type(o) for o in out] == [
        EmbedResult,
        InvalidInputError,
        InvalidInputError,
        EmbedResult,
    ]
    assert isinstance(out[1], InvalidInputError) and out[1].reason == "invalid_input"
    assert "outside the vocabulary" in str(out[1])
    assert "float" in str(out[2])
    assert isinstance(out[0], EmbedResult) and isinstance(out[3], EmbedResult)
    np.testing.assert_array_equal(out[0].hidden_states, small_rows[[[1]]])
    np.testing.assert_array_equal(out[3].hidden_states, small_rows[[[4]]])
    assert requests_of(real_server, "EmbedStream") == 3  # the float input never left
    assert requests_of(real_server, "EmbedStream", code="INVALID_ARGUMENT") == 1


def test_stream_item_errors_carry_their_reasons(
    start_server: Start, small_model_dir: Path, small_rows: np.ndarray
) -> None:
    server = start_server(small_model_dir, max_tokens_per_request=64)
    inputs = [[[1, 2]], [[SMALL_V]], [list(range(65))], [[3]]]
    with client_for(server) as client:
        out = list(client.embed_stream_results(inputs, return_exceptions=True))
    assert [type(o) for o in out] == [
        EmbedResult, InvalidInputError, RequestTooLargeError, EmbedResult,
    ]  # fmt: skip
    errors = [o for o in out if isinstance(o, EmbeddingError)]
    assert [(e.code, e.reason) for e in errors] == [
        (SC.INVALID_ARGUMENT, "invalid_input"),
        (SC.RESOURCE_EXHAUSTED, "too_large"),
    ]
    assert "65 tokens, over the limit of 64" in str(errors[1])
    results = [o for o in out if isinstance(o, EmbedResult)]
    np.testing.assert_array_equal(results[0].hidden_states, small_rows[[[1, 2]]])
    np.testing.assert_array_equal(results[1].hidden_states, small_rows[[[3]]])


def test_stream_tells_overloaded_from_too_large_by_reason(
    held: HeldServer, small_rows: np.ndarray
) -> None:
    """Both are RESOURCE_EXHAUSTED; only the stream item's reason tells "retry later" from
    "never retry"."""
    held.fill_queue()
    inputs = [[[1, 2, 3]], [list(range(65))], [[4]]]  # overloaded, too large, then queued
    with client_for(held.server) as client:
        results = client.embed_stream_results(inputs, return_exceptions=True)
        overloaded, too_large = next(results), next(results)
        held.release()  # the third waits at the gate until now
        last = next(results)
        assert list(results) == []
    assert type(overloaded) is OverloadedError and overloaded.reason == "overloaded"
    assert type(too_large) is RequestTooLargeError and too_large.reason == "too_large"
    assert overloaded.code == too_large.code == SC.RESOURCE_EXHAUSTED
    assert isinstance(last, EmbedResult)
    np.testing.assert_array_equal(last.hidden_states, small_rows[[[4]]])


def test_stream_client_refusal_raises_in_turn(
    real_server: ServerThread, small_rows: np.ndarray
) -> None:
    got: list[np.ndarray] = []
    with client_for(real_server) as client, pytest.raises(InvalidInputError, match="float"):
        for hs in client.embed_stream([[[1]], [[2]], [[0.5]], [[3]]]):
            got.append(hs)
    np.testing.assert_array_equal(np.concatenate(got), small_rows[[[1], [2]]])


def test_stream_input_failure_reaches_the_caller(real_server: ServerThread) -> None:
    class Boom(Exception):
        pass

    def inputs() -> Iterator[list[list[int]]]:
        yield [[1]]
        raise Boom("the input source broke")

    with client_for(real_server) as client, pytest.raises(Boom, match="input source"):
        list(client.embed_stream(inputs()))


def test_stream_input_failure_comes_after_earlier_items(
    real_server: ServerThread, small_rows: np.ndarray
) -> None:
    class Boom(Exception):
        pass

    def inputs() -> Iterator[Any]:
        yield [[1]]
        yield [[0.5]]  # refused by the client
        raise Boom("late")

    got: list[Any] = []
    with client_for(real_server) as client, pytest.raises(Boom, match="late"):
        for item in client.embed_stream_results(inputs(), return_exceptions=True):
            got.append(item)
    assert [type(g) for g in got] == [EmbedResult, InvalidInputError]
    np.testing.assert_array_equal(got[0].hidden_states, small_rows[[[1]]])


def test_stream_against_a_server_that_is_not_there() -> None:
    with client_for(f"127.0.0.1:{free_port()}") as client, pytest.raises(UnavailableError):
        list(client.embed_stream([[[1]]]))
