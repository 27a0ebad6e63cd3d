"""Hold the real backend at a gate, so tests can line requests up deterministically.

The loader is the server's public injection point (``TokembedServer(loader=...)``); the
wrapped backend is the real one (onnxruntime's, or the table's), only made to wait
before each look-up. Servers using it must run with ``inline_compute_max_tokens=0``: a
look-up held on the event loop would hold the whole server.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tokembed.server.backends.base import Backend, LookUp, Rows
from tokembed.server.core.dtypes import DType
from tokembed.server.core.types import TokenIds
from tokembed.server.loading import LoadedModel, load_model
from tokembed.server.settings import Settings


class GatedBackend(Backend):
    """The real backend, each look-up (and batch) held at ``gate`` and recorded."""

    def __init__(self, inner: Backend, gate: threading.Event) -> None:
        self._inner = inner
        self.gate = gate
        self.entered = threading.Event()  # set when a look-up is waiting at the gate
        self.calls: list[np.ndarray] = []  # ids of every look-up (a batch's all), in order
        self.fail_next = False
        self.kind = inner.kind
        self.execution_provider = inner.execution_provider
        self.d_model = inner.d_model
        self.batches = inner.batches

    def look_up(self, request: LookUp) -> Rows:
        self._enter([request.ids])
        return self._inner.look_up(request)

    def look_up_batch(self, requests: Sequence[LookUp]) -> list[Rows]:
        self._enter([request.ids for request in requests])
        return self._inner.look_up_batch(requests)

    def pad_row(self, dtype: DType) -> bytes:
        return self._inner.pad_row(dtype)

    def _enter(self, ids: list[TokenIds]) -> None:
        self.calls.append(np.concatenate([i.array() for i in ids]))
        self.entered.set()
        if not self.gate.wait(timeout=60):
            raise TimeoutError("test gate never opened")
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected onnxruntime failure")


class GatedLoader:
    """``loader=`` for the server: loads for real, then gates look-ups (and, optionally,
    the end of loading itself, to observe the NOT_SERVING phase)."""

    def __init__(self, *, open_look_ups: bool = True, open_loading: bool = True) -> None:
        self.look_up_gate = threading.Event()
        self.loading_gate = threading.Event()
        if open_look_ups:
            self.look_up_gate.set()
        if open_loading:
            self.loading_gate.set()
        self.backend: GatedBackend | None = None  # the last model loaded
        self.backends: dict[str, GatedBackend] = {}  # every model's, by its name

    def __call__(self, directory: Path, settings: Settings) -> LoadedModel:
        loaded = load_model(directory, settings)
        self.backend = GatedBackend(loaded.backend, self.look_up_gate)
        self.backends[loaded.model.manifest.name] = self.backend
        if not self.loading_gate.wait(timeout=60):
            raise TimeoutError("test loading gate never opened")
        return dataclasses.replace(loaded, backend=self.backend)
