"""A loader whose runtime fails any look-up that contains a chosen id (the "poison").

The real onnxruntime runtime, behind the shared gate (support.gates), so a test can line
several requests up into one batch, then make exactly that batch fail.
"""

from __future__ import annotations

import threading

import numpy as np

from tokembed.server.app import LoadedModel, load_model
from tokembed.server.settings import Settings

from support.gates import GatedRuntime


class PoisonRuntime(GatedRuntime):
    poison: int | None = None

    def run(self, ids: np.ndarray) -> np.ndarray:
        rows = super().run(ids)  # recorded, and held at the gate
        if self.poison is not None and bool(np.any(ids == self.poison)):
            raise RuntimeError(f"injected onnxruntime failure (batch holds id {self.poison})")
        return rows


class PoisonLoader:
    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.runtime: PoisonRuntime | None = None

    def __call__(self, settings: Settings) -> LoadedModel:
        loaded = load_model(settings)
        self.runtime = PoisonRuntime(loaded.runtime, self.gate)
        return LoadedModel(
            model=loaded.model,
            runtime=self.runtime,  # type: ignore[arg-type]
            warm_up_s=loaded.warm_up_s,
            pad_row=loaded.pad_row,
            float16_table=loaded.float16_table,
        )
