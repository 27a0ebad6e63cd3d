"""Hold the real runtime at a gate, so tests can line requests up deterministically.

The loader is the server's public injection point (``TokembedServer(loader=...)``); the
wrapped runtime is the real onnxruntime one, only made to wait before each look-up.
Servers using it must run with ``inline_compute_max_tokens=0``: a look-up held on the
event loop would hold the whole server.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from tokembed.server.app import LoadedModel, load_model
from tokembed.server.settings import Settings


class GatedRuntime:
    def __init__(self, inner: Any, gate: threading.Event) -> None:
        self._inner = inner
        self.gate = gate
        self.entered = threading.Event()  # set when a look-up is waiting at the gate
        self.calls: list[np.ndarray] = []  # ids of every look-up, in order
        self.fail_next = False
        self.provider = inner.provider

    def run(self, ids: np.ndarray) -> np.ndarray:
        self.calls.append(ids.copy())
        self.entered.set()
        if not self.gate.wait(timeout=60):
            raise TimeoutError("test gate never opened")
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected onnxruntime failure")
        return self._inner.run(ids)  # type: ignore[no-any-return]

    def to_float16(self, rows: np.ndarray) -> np.ndarray:
        return self._inner.to_float16(rows)  # type: ignore[no-any-return]


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
        self.runtime: GatedRuntime | None = None

    def __call__(self, settings: Settings) -> LoadedModel:
        loaded = load_model(settings)
        self.runtime = GatedRuntime(loaded.runtime, self.look_up_gate)
        if not self.loading_gate.wait(timeout=60):
            raise TimeoutError("test loading gate never opened")
        return LoadedModel(
            model=loaded.model,
            runtime=self.runtime,
            warm_up_s=loaded.warm_up_s,  # type: ignore[arg-type]
            pad_row=loaded.pad_row,
        )
