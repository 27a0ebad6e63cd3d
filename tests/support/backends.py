"""The real backend with a test's hooks: each look-up recorded, held at a gate, made to fail.

``HookedBackend`` wraps a backend as the server loads it (onnxruntime's, or the table's)
and computes with it; the hooks only add, around each look-up (one request's, or a
batch's), what a test needs to line requests up deterministically and to see what a
failure does:

- recorded: ``calls`` (the ids, each request's token count, the thread), and ``entered``;
- held at a ``Gate`` while it is closed (``gate.held`` says a look-up waits there);
- failed, as a runtime failure that is no domain error fails: ``fail_next`` (the next
  look-up), ``fail_when`` (a look-up holding a request it names: a poison id, a dtype);
- broken, as a backend bug: ``lose_last_row`` (each request's rows come back one short).

``HookedLoader`` is the server's public injection point (``TokembedServer(loader=...)``,
``start_server(..., loader=...)``): it loads each model for real, then hooks its backend.
Tests that build the data plane by hand wrap a loaded backend themselves.

A server whose look-ups a gate holds runs with ``HOLDABLE`` settings.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokembed.server.backends.base import Backend, LookUp, Rows
from tokembed.server.backends.head import Found, NearestHead, Query
from tokembed.server.core.dtypes import INT64, DType
from tokembed.server.core.types import TokenIds
from tokembed.server.models.loading import LoadedModel, load_model
from tokembed.server.process.settings import Settings

# A server whose look-ups may be held: the onnxruntime backend, which batches (so requests
# queue behind a held batch), and every look-up off the event loop (a look-up inline on the
# loop, as small ones are by default, would hold the whole server while it waits).
HOLDABLE = {"inline_compute_max_tokens": 0, "float32_table_max_bytes": 0}

# The message of the failure a request must cause, or None: it fails the whole look-up
# (a batch's every caller), as a runtime error would.
FailWhen = Callable[[LookUp], "str | None"]


class Gate:
    """Where look-ups wait while it is closed (one gate may hold several backends)."""

    def __init__(self, *, open: bool = True, timeout_s: float = 60) -> None:
        self._open = threading.Event()
        if open:
            self._open.set()
        self.timeout_s = timeout_s
        self.held = threading.Event()  # a look-up found the gate closed (since close())

    def close(self) -> None:
        self.held.clear()
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def pass_through(self) -> None:
        if not self._open.is_set():
            self.held.set()
            if not self._open.wait(self.timeout_s):
                raise TimeoutError(f"the test's gate was left closed for {self.timeout_s} s")


@dataclass(frozen=True)
class LookUpCall:
    """One look-up the backend was asked for."""

    ids: np.ndarray  # every request's ids, concatenated in order
    counts: list[int]  # each request's token count
    thread: str  # the name of the thread it ran on


class HookedBackend(Backend):
    """The real backend ``inner``, with the hooks of this module."""

    def __init__(
        self,
        inner: Backend,
        gate: Gate | None = None,
        *,
        fail_when: FailWhen | None = None,
        lose_last_row: bool = False,
    ) -> None:
        self._inner = inner
        self.gate = Gate() if gate is None else gate
        self.fail_when = fail_when
        self.fail_next = False  # the next look-up fails (once)
        self.lose_last_row = lose_last_row
        self.calls: list[LookUpCall] = []
        self.entered = threading.Event()  # set at each look-up, before the gate
        self.closed = 0  # close() calls: counted, not passed on (loaded backends are shared)
        self.kind = inner.kind
        self.execution_provider = inner.execution_provider
        self.d_model = inner.d_model
        self.batches = inner.batches
        # nearest's searches: recorded (each query's vectors, per search) and held at the
        # same gate as the look-ups.
        self.searches: list[list[int]] = []
        self.head = None if inner.head is None else HookedHead(inner.head, self)

    @property
    def memory_bytes(self) -> dict[str, int]:
        return self._inner.memory_bytes

    def look_up(self, request: LookUp) -> Rows:
        self._enter([request])
        return self._inner.look_up(self._cut(request))

    def look_up_batch(self, requests: Sequence[LookUp]) -> list[Rows]:
        self._enter(requests)
        return self._inner.look_up_batch([self._cut(request) for request in requests])

    def pad_row(self, dtype: DType) -> bytes:
        return self._inner.pad_row(dtype)

    def close(self) -> None:
        self.closed += 1

    def _enter(self, requests: Sequence[LookUp]) -> None:
        ids = np.concatenate([request.ids.array() for request in requests])
        counts = [request.ids.count for request in requests]
        self.calls.append(LookUpCall(ids, counts, threading.current_thread().name))
        self.entered.set()
        self.gate.pass_through()
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected onnxruntime failure")
        fail_when = self.fail_when
        for request in requests if fail_when is not None else ():
            message = fail_when(request)
            if message is not None:
                raise RuntimeError(message)

    def _cut(self, request: LookUp) -> LookUp:
        if not self.lose_last_row:
            return request
        kept = request.ids.array()[:-1]
        return LookUp(TokenIds(kept.astype("<i8").tobytes(), INT64, len(kept)), request.dtype)


class HookedHead(NearestHead):
    """The real head ``inner`` (its table, read where it is), each search recorded and
    held at its backend's gate."""

    def __init__(self, inner: NearestHead, backend: HookedBackend) -> None:
        super().__init__(inner.table, inner.norm, inner.table_role, shared=inner.shared)
        # What it shares with its backend, not the backend itself: no reference cycle.
        self._searches = backend.searches
        self._entered = backend.entered
        self._gate = backend.gate

    def search(self, queries: Sequence[Query]) -> list[Found]:
        self._searches.append([len(query.vectors) for query in queries])
        self._entered.set()
        self._gate.pass_through()
        return super().search(queries)


async def entered(backend: HookedBackend, timeout_s: float = 30) -> None:
    """Wait (without blocking the event loop) until a look-up reached ``backend``."""
    reached = await asyncio.to_thread(backend.entered.wait, timeout_s)
    assert reached, "no look-up reached the backend"


def failing(message: str = "injected look-up failure") -> FailWhen:
    """Every look-up fails with ``message``."""
    return lambda request: message


def poisoned_by(token_id: int) -> FailWhen:
    """A look-up holding ``token_id`` (in any of its requests) fails."""

    def fail_when(request: LookUp) -> str | None:
        if token_id in request.ids.values():
            return f"injected onnxruntime failure (batch holds id {token_id})"
        return None

    return fail_when


class HookedLoader:
    """``loader=`` for the server: each model loaded for real (``load_model``), its backend
    a ``HookedBackend`` at ``look_up_gate``; loading itself waits at ``loading_gate`` (to
    observe the NOT_SERVING phase)."""

    def __init__(
        self,
        *,
        look_up_gate: Gate | None = None,
        open_look_ups: bool = True,
        open_loading: bool = True,
        fail_when: FailWhen | None = None,
    ) -> None:
        self.look_up_gate = Gate(open=open_look_ups) if look_up_gate is None else look_up_gate
        self.loading_gate = Gate(open=open_loading)
        self.fail_when = fail_when
        self.backend: HookedBackend | None = None  # the last model loaded
        self.backends: dict[str, HookedBackend] = {}  # every model's, by its name

    def __call__(self, directory: Path, settings: Settings) -> LoadedModel:
        loaded = load_model(directory, settings)
        backend = HookedBackend(loaded.backend, self.look_up_gate, fail_when=self.fail_when)
        self.backend = self.backends[loaded.model.manifest.name] = backend
        self.loading_gate.pass_through()
        return dataclasses.replace(loaded, backend=backend)
