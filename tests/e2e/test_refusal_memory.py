"""A refused request's bytes are freed when it is answered, without the cyclic collector:
no refusal path, in either protocol, leaves a reference cycle holding them.

The real server in this process, the cyclic collector off for the test (``gc.disable``),
``tracemalloc`` counting what Python holds: each path refuses large requests repeatedly
and what stays allocated afterwards must be a small fraction of one request. Before, the
stored exception's traceback kept the parser's (or the data plane's) frame, with the
request's bytes, in a cycle that only a collection freed.
"""

from __future__ import annotations

import gc
import logging
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tokembed.v1 import embedding_pb2 as v1
from tokembed.v2 import grpc_service_pb2 as v2

from support.fixtures import SMALL_V

MODEL = "small"
IDS = 65536  # the default max_tokens_per_request: 512 KiB of int64 ids
REPEATS = 6


@pytest.fixture
def no_collector(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """The cyclic collector off, and no log record kept (a captured record holds its
    error, and so the request, as long as the capture lives)."""
    caplog.set_level(logging.CRITICAL, logger="tokembed")
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _ids(bad: bool) -> np.ndarray:
    ids = np.arange(IDS, dtype=np.int64) % SMALL_V
    if bad:
        ids[-1] = SMALL_V  # out of the vocabulary: refused by validation
    return ids.reshape(1, IDS)


def _v2(inputs: list[tuple[str, np.ndarray]], extra_raw: int = 0) -> bytes:
    request = v2.ModelInferRequest(model_name=MODEL)
    for name, ids in inputs:
        request.inputs.add(name=name, datatype="INT64", shape=list(ids.shape))
        request.raw_input_contents.append(ids.tobytes())
    for _ in range(extra_raw):
        request.raw_input_contents.append(b"\0" * (IDS * 8))
    return request.SerializeToString()


def _v1(ids: np.ndarray) -> bytes:
    request = v1.EmbedRequest(model_name=MODEL)
    request.input_ids.dtype = v1.DTYPE_INT64
    request.input_ids.shape.extend(ids.shape)
    request.input_ids.data = ids.tobytes()
    return request.SerializeToString()


REFUSALS: dict[str, tuple[str, Callable[[], bytes]]] = {
    # V2: refused by its deserializer, by validation, and for an input the model lacks.
    "v2 parser": ("/inference.GRPCInferenceService/ModelInfer",
                  lambda: _v2([("input_ids", _ids(False))], extra_raw=1)),
    "v2 validation": ("/inference.GRPCInferenceService/ModelInfer",
                      lambda: _v2([("input_ids", _ids(True))])),
    "v2 unknown input": ("/inference.GRPCInferenceService/ModelInfer",
                         lambda: _v2([("input_ids", _ids(False)), ("x", _ids(False))])),
    # tokembed.v1: bytes that do not parse, and ids refused by validation.
    "v1 parser": ("/tokembed.v1.EmbeddingService/Embed", lambda: b"\xff" * (IDS * 8)),
    "v1 validation": ("/tokembed.v1.EmbeddingService/Embed", lambda: _v1(_ids(True))),
}  # fmt: skip


@pytest.mark.parametrize("path", list(REFUSALS))
def test_a_refused_request_is_freed_without_the_cyclic_collector(
    start_server: Any, small_model_dir: Path, no_collector: None, path: str
) -> None:
    server = start_server(small_model_dir)
    method, make = REFUSALS[path]
    body = make()
    size = len(body)
    with grpc.insecure_channel(server.target) as channel:
        call = channel.unary_unary(method)

        def refuse() -> None:
            with pytest.raises(grpc.RpcError) as caught:
                call(body, timeout=30)
            assert caught.value.code() in (
                grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
            ), caught.value  # fmt: skip

        refuse()  # first-use allocations (metric series, log summaries) aside
        tracemalloc.start(25)
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(REPEATS):
                refuse()
            # The server's handler may still be ending when the caller has its status.
            kept = tracemalloc.get_traced_memory()[0] - before
            for _ in range(200):
                if kept < size // 2:
                    break
                time.sleep(0.05)
                kept = tracemalloc.get_traced_memory()[0] - before
            snap = tracemalloc.take_snapshot()
            for stat in snap.statistics("traceback")[:3]:
                print(stat)
                for line in stat.traceback.format()[-12:]:
                    print("   ", line)
        finally:
            tracemalloc.stop()
    # Before: every refused request's bytes stayed (at least REPEATS x len(body)).
    assert kept < size // 2, f"{kept} bytes still held after {REPEATS} refusals of {size}"
