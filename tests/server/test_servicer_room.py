"""Embed holds an answer's room (admission's in-flight output bytes) until gRPC is done
sending it: until the RPC ends, which gRPC tells through the context's done callbacks.
Here a context plays gRPC's part: it records the callbacks and runs them at "the end"."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from tokembed.server.core.admission import OutputBudget
from tokembed.server.core.calls import Calls
from tokembed.server.core.dataplane import DataPlane
from tokembed.server.core.policy import Policy
from tokembed.server.core.repository import Repository
from tokembed.server.core.scheduler import Scheduler
from tokembed.server.core.served import BatchLimits, Limits, ServedModel
from tokembed.server.edge.v1.requests import EmbedParser, parse_embed
from tokembed.server.edge.v1.servicer import EmbeddingServicer
from tokembed.server.models.loading import LoadedModel
from tokembed.v1 import embedding_pb2 as pb

from support.fixtures import SMALL_D, SMALL_V
from support.requests import encode


class Context:
    """What Embed asks of gRPC's context on success: no deadline, and done callbacks."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[Any], None]] = []

    def time_remaining(self) -> float | None:
        return None

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self.callbacks.append(callback)

    def end(self) -> None:
        for callback in self.callbacks:
            callback(self)


def request(ids: np.ndarray, output_dtype: int = pb.DTYPE_FLOAT32) -> Any:
    return parse_embed(encode(ids, output_dtype=output_dtype))


@pytest.mark.parametrize("dtype", ["<i8", "<i4"])
@pytest.mark.parametrize("tokens", [16, 8192], ids=["inline", "off-loop"])
def test_embed_holds_the_room_until_its_rpc_ends(
    small_loaded: LoadedModel, small_rows: np.ndarray, dtype: str, tokens: int
) -> None:
    ids = np.random.default_rng(9).integers(0, SMALL_V, (2, tokens // 2)).astype(dtype)
    budget = OutputBudget(1 << 30)
    workers = ThreadPoolExecutor(2)
    served = ServedModel(
        small_loaded.model,
        small_loaded.backend,
        Limits(max_tokens_per_request=65536, max_output_bytes_per_request=1 << 30),
        BatchLimits(16384, 0.002, 1, 262144),
    )
    scheduler = Scheduler(
        served, policy=Policy(batches=False, inline_max_tokens=256), budget=budget,
        workers=workers,
    )  # fmt: skip
    repository = Repository()
    handle = repository.add(scheduler)
    repository.activate(handle)
    repository.started()
    servicer = EmbeddingServicer(
        DataPlane(repository, Calls(None)), chunk_bytes=1 << 20, max_message_bytes=0,
        parse=EmbedParser(1 << 30, 65536),
    )  # fmt: skip

    async def go() -> bytes:
        context = Context()
        payload = await servicer.Embed(request(ids), context)  # type: ignore[arg-type]
        for _ in range(3):
            await asyncio.sleep(0)
        # Answered, not yet sent: the room, and the model version's lease, are held.
        assert budget.inflight_bytes == ids.size * SMALL_D * 4
        assert handle.leases == 1
        context.end()
        assert budget.inflight_bytes == 0 and handle.leases == 0
        return payload

    try:
        payload = asyncio.run(go())
    finally:
        workers.shutdown()
    got = pb.EmbedResponse.FromString(payload).hidden_states
    rows = np.frombuffer(got.data, "<f4").reshape(tuple(got.shape))
    np.testing.assert_array_equal(rows, small_rows[ids.astype(np.int64)])
