"""``Refused``: a request its front end could not translate holds nothing of the request's
bytes once refused, and raising it through the data plane makes no reference cycle.

With the cyclic collector off, a large request refused by each protocol's deserializer,
then refused by the data plane as a front end hands it over: the request's bytes are
referenced exactly as often as before it was parsed (``sys.getrefcount``), and the
refusal itself is freed by reference counting alone (its own count is back where it was).
Through the real server, the same is shown by memory: tests/e2e/test_refusal_memory.py.
"""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from tokembed.server.core.calls import Calls, FrontEnd
from tokembed.server.core.dataplane import DataPlane, Refused, Sink
from tokembed.server.core.errors import EmbedError, InvalidInput
from tokembed.server.core.operations.embed import EMBED
from tokembed.server.core.repository import Repository
from tokembed.server.edge.v1.requests import EmbedParser
from tokembed.server.edge.v2.requests import InferParser
from tokembed.v2 import grpc_service_pb2 as v2

FRONT_END = FrontEnd("test", {"Embed": "embed"}, lambda error: error.reason)
IDS = 1 << 16


class NoSink(Sink[bytes]):
    def frame(self, answer: Any, call: Any) -> bytes:
        raise AssertionError("a refused request is never framed")

    async def send(self, framed: bytes, sent: Callable[[], None]) -> None:
        raise AssertionError("a refused request is never sent")


@pytest.fixture
def no_collector(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """The cyclic collector off, and no refusal logged: a captured log record holds its
    error (and so the frames that raised it) as long as the capture lives."""
    caplog.set_level(logging.CRITICAL, logger="tokembed")
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def v2_two_raw_for_one_input() -> bytes:
    """Refused inside the V2 deserializer, below its first frame (a raised error)."""
    request = v2.ModelInferRequest(model_name="small")
    request.inputs.add(name="input_ids", datatype="INT64", shape=[1, IDS])
    for _ in range(2):
        request.raw_input_contents.append(np.zeros(IDS, "<i8").tobytes())
    return request.SerializeToString()


PARSERS: dict[str, tuple[Callable[[bytes], Any], Callable[[], bytes]]] = {
    "v2 parser": (InferParser(1 << 22, IDS), v2_two_raw_for_one_input),
    "v2 over the limit": (InferParser(1 << 10, 64), v2_two_raw_for_one_input),
    "v1 not a message": (EmbedParser(1 << 22, IDS), lambda: b"\xff" * (IDS * 8)),
}


@pytest.mark.parametrize("path", list(PARSERS))
def test_a_refusal_holds_no_bytes_and_raising_it_makes_no_cycle(
    no_collector: None, path: str
) -> None:
    parse, make = PARSERS[path]
    data = make()
    references = sys.getrefcount(data)
    refused = parse(data)
    assert isinstance(refused, Refused)
    assert sys.getrefcount(data) == references
    held = sys.getrefcount(refused)
    plane = DataPlane(Repository(), Calls(None))

    # Driven by hand, without an event loop (whose own objects hold a task's result): a
    # refusal raises before the data plane awaits anything.
    serving = plane.serve(FRONT_END, "Embed", EMBED, refused, None, NoSink())
    try:
        serving.send(None)
    except EmbedError as raised:
        error = raised
    else:
        raise AssertionError("the refusal was served")
    del serving
    assert error.__traceback__ is not None  # raised, with the data plane's frames
    del error
    assert sys.getrefcount(refused) == held, "the refusal is kept alive by a cycle"
    assert sys.getrefcount(data) == references


def test_each_raise_is_a_new_exception_with_the_same_class_and_message() -> None:
    refused = Refused(InvalidInput("input 'x' is bad"), "id-1")
    first, second = refused.error, refused.error
    assert first is not second
    assert type(first) is InvalidInput and str(first) == "input 'x' is bad"
    assert refused.request_id == "id-1"
