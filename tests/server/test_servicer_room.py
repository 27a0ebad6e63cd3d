"""Embed holds an answer's room (admission's in-flight output bytes) until gRPC is done
sending it: until the RPC's task ends, which gRPC lets happen only once the answer's
batch of operations is done. Here a task plays gRPC's part: it runs the handler, then
waits for "the send" before it ends."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from tokembed.server import wire
from tokembed.server.app import LoadedModel
from tokembed.server.service import EmbeddingService
from tokembed.server.servicer import EmbeddingServicer
from tokembed.server.serving_state import ServingState
from tokembed.server.settings import Settings
from tokembed.v1 import embedding_pb2 as pb

from support.fixtures import SMALL_D, SMALL_V


class Context:
    """What Embed asks of gRPC's context on success: no deadline."""

    def time_remaining(self) -> float | None:
        return None


def request(ids: np.ndarray) -> Any:
    dtype = pb.DTYPE_INT32 if ids.dtype == np.int32 else pb.DTYPE_INT64
    tensor = pb.Tensor(dtype=dtype, shape=ids.shape, data=ids.tobytes())
    return wire.parse_request(pb.EmbedRequest(input_ids=tensor).SerializeToString())


@pytest.mark.parametrize("dtype", ["<i8", "<i4"])  # the plain path, the general path
def test_embed_holds_the_room_until_its_rpc_task_ends(
    small_loaded: LoadedModel, small_rows: np.ndarray, dtype: str
) -> None:
    ids = np.random.default_rng(9).integers(0, SMALL_V, (2, 8)).astype(dtype)
    service = EmbeddingService(
        small_loaded.model, small_loaded.runtime.run, small_loaded.runtime.provider,
        Settings(model_dir=small_loaded.model.path), pad_row=small_loaded.pad_row,
        float32_table=small_loaded.float32_table,
    )  # fmt: skip
    state = ServingState()
    state.service = service
    servicer = EmbeddingServicer(state)

    async def go() -> None:
        answered, sent = asyncio.Event(), asyncio.Event()

        async def rpc() -> bytes:  # as gRPC's task: the handler, then the send
            payload = await servicer.Embed(request(ids), Context())  # type: ignore[arg-type]
            answered.set()
            await sent.wait()
            return payload

        try:
            task = asyncio.ensure_future(rpc())
            await answered.wait()
            for _ in range(3):
                await asyncio.sleep(0)
            assert service.admission.inflight_output_bytes == ids.size * SMALL_D * 4
            sent.set()
            payload = await task
            await asyncio.sleep(0)  # the task's done callbacks run soon after it ends
            assert service.admission.inflight_output_bytes == 0
        finally:
            await service.close()
        got = pb.EmbedResponse.FromString(payload).hidden_states
        rows = np.frombuffer(got.data, "<f4").reshape(tuple(got.shape))
        np.testing.assert_array_equal(rows, small_rows[ids.astype(np.int64)])

    asyncio.run(go())
