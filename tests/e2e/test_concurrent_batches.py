"""End to end: --max-concurrent-batches is how many batches compute at the same time.

The real server and client, the onnxruntime backend (whose requests batch) held at the
gate of tests/support/backends.py: while the gate is closed, every batch that started
computing waits there, so the look-ups at the gate are the batches computing at once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokembed.client import AsyncEmbeddingClient

from support.backends import HOLDABLE, HookedLoader
from support.server import wait_for_async

REQUESTS = 6


@pytest.mark.parametrize("concurrent", [1, 2, 3])
def test_max_concurrent_batches_is_how_many_batches_compute_at_once(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray, concurrent: int
) -> None:
    loader = HookedLoader(open_look_ups=False)
    server = start_server(
        small_model_dir,
        loader=loader,
        **HOLDABLE,  # every batch off the event loop, to the gate; onnxruntime: requests batch
        max_batch_tokens=1,  # one one-token request a batch
        max_concurrent_batches=concurrent,
    )
    backend = loader.backend
    assert backend is not None and backend.batches

    def queued() -> float:
        return server.metric("tokembed_queued_tokens")

    ids = [[[100 + i]] for i in range(REQUESTS)]

    async def scenario() -> tuple[int, float, list[np.ndarray]]:
        async with AsyncEmbeddingClient(server.target, retries=0) as client:
            calls = [asyncio.ensure_future(client.embed(one)) for one in ids]
            try:
                # ``concurrent`` batches computing (each at the gate), the others queued.
                assert await wait_for_async(
                    lambda: len(backend.calls) == concurrent and queued() == REQUESTS - concurrent,
                    30,
                ), (len(backend.calls), queued())
                # A round trip through the server's event loop after the last request was
                # queued: its batcher has had its turn since, and would have started
                # another batch (taking it from the queue) had the setting allowed one more.
                assert await client.health() == "SERVING"
                held = len(backend.calls), queued()
            finally:
                loader.look_up_gate.open()
            return *held, list(await asyncio.gather(*calls))

    at_gate, still_queued, results = asyncio.run(scenario())
    assert (at_gate, still_queued) == (concurrent, REQUESTS - concurrent)
    for one, got in zip(ids, results, strict=True):
        np.testing.assert_array_equal(got, small_rows[one])
    # Every request its own batch, each computed once.
    assert sorted(call.ids.tolist() for call in backend.calls) == [
        [100 + i] for i in range(REQUESTS)
    ]
    assert server.metric("tokembed_batches_total") == REQUESTS
