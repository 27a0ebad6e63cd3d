"""Helpers of the client's tests against the real server (fixtures are in conftest.py).

The server's own record of what it was asked is its metrics: ``tokembed_requests_total``
counts every RPC it finished by method, status code and model (EmbedStream: one per
request), so a test reads there which calls the client made, instead of a fake's log.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from tokembed.client import AsyncEmbeddingClient, EmbeddingClient

from support.backends import HOLDABLE, HookedLoader
from support.server import ServerThread, wait_for

SENTENCE = [[5, 6, 7, 8, 9, 10, 11, 12]]  # "The keys on the table are lost."
SMALL_NAME = "small"  # the names support.fixtures exports its models under
DECODER_NAME = "decoder"


def client_for(server: ServerThread | str, **kwargs: Any) -> EmbeddingClient:
    """An EmbeddingClient of ``server`` (or a target); 30 s per call unless told."""
    target = server if isinstance(server, str) else server.target
    kwargs.setdefault("timeout_s", 30.0)
    return EmbeddingClient(target, **kwargs)


def async_client_for(server: ServerThread | str, **kwargs: Any) -> AsyncEmbeddingClient:
    """As :func:`client_for`, the asyncio client."""
    target = server if isinstance(server, str) else server.target
    kwargs.setdefault("timeout_s", 30.0)
    return AsyncEmbeddingClient(target, **kwargs)


def requests_of(
    server: ServerThread, method: str, *, code: str | None = None, model: str | None = None
) -> int:
    """RPCs ``method`` the server finished (with ``code``, for ``model``, when given).

    Embed, GetModelInfo, ListModels, EmbedStream items and refusals are counted before their
    answer is sent, so a count read once the client has its answer is final. EmbedChunked
    is counted after its last chunk went out, and a call its caller left once the server
    notices: wait for those (``wait_for``). Calls refused for their bearer token are
    counted only in :func:`rejections`.
    """
    labels = {"method": method}
    if code is not None:
        labels["code"] = code
    if model is not None:
        labels["model"] = model
    return int(server.metric("tokembed_requests_total", labels))


def rejections(server: ServerThread, reason: str) -> int:
    """Requests the server refused for ``reason`` (the bearer-token check included)."""
    return int(server.metric("tokembed_rejections_total", {"reason": reason}))


class HeldServer:
    """The real server (one model), every look-up held at a gate until :meth:`release`.

    :meth:`fill_queue` sends one request that waits at the gate and one of ``QUEUED``
    tokens that waits in the queue behind it: from then on any request of more than
    ``MAX_QUEUED - QUEUED`` tokens is refused RESOURCE_EXHAUSTED/overloaded, at once, and
    any smaller one waits for the gate. Look-ups run off the event loop (a held look-up on
    the loop would hold the whole server) and through onnxruntime, whose batcher keeps the
    queue (tests/support/backends.py).
    """

    MAX_QUEUED = 10
    QUEUED = 8

    def __init__(
        self,
        start_server: Callable[..., ServerThread],
        model_dir: Path,
        table: np.ndarray,
        **settings: Any,
    ) -> None:
        self.loader = HookedLoader(open_look_ups=False)
        self.table = table
        self.server = start_server(
            model_dir,
            loader=self.loader,
            **HOLDABLE,
            max_queued_tokens=self.MAX_QUEUED,
            **settings,
        )
        self._pool = ThreadPoolExecutor(2)
        self._client = EmbeddingClient(
            self.server.target, retries=0, chunked_threshold_bytes=None, timeout_s=60
        )
        self._held: list[tuple[list[list[int]], Future[np.ndarray]]] = []

    def fill_queue(self) -> None:
        backend = self.loader.backend
        assert backend is not None
        self._send([[1]])
        assert wait_for(backend.entered.is_set, 30), "the first request never reached the gate"
        self._send([list(range(self.QUEUED))])
        assert wait_for(lambda: self.server.metric("tokembed_queued_tokens") == self.QUEUED, 30), (
            "the second request never queued"
        )

    def release(self) -> None:
        """Open the gate; the held requests get their exact rows."""
        self.loader.look_up_gate.open()
        for ids, future in self._held:
            np.testing.assert_array_equal(future.result(60), self.table[ids])

    def close(self) -> None:
        self.loader.look_up_gate.open()  # never leave a look-up (and the server's stop) hanging
        self._pool.shutdown(wait=True)
        self._client.close()

    def _send(self, ids: list[list[int]]) -> None:
        self._held.append((ids, self._pool.submit(self._client.embed, ids)))


class LoadingServer:
    """The real server, its port open and its models still loading (health NOT_SERVING,
    calls answered UNAVAILABLE) until :meth:`finish_loading`."""

    def __init__(
        self, start_server: Callable[..., ServerThread], model_dirs: tuple[Path, ...]
    ) -> None:
        self.loader = HookedLoader(open_loading=False)
        self.server = start_server(model_dirs, loader=self.loader, wait_ready=False)

    def finish_loading(self) -> None:
        self.loader.loading_gate.open()
        assert self.server.server is not None
        self.server.call(self.server.server.wait_ready())

    def close(self) -> None:
        self.loader.loading_gate.open()  # the server's stop waits for loading to end
