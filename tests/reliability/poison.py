"""A loader whose backend fails any look-up that contains a chosen id (the "poison").

The real backend behind the shared gate (support.gates), so a test can line several
requests up into one batch (with the onnxruntime backend, which batches), then make
exactly that batch fail.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from pathlib import Path

from tokembed.server.backends.base import LookUp, Rows
from tokembed.server.loading import LoadedModel, load_model
from tokembed.server.settings import Settings

from support.gates import GatedBackend


class PoisonBackend(GatedBackend):
    poison: int | None = None

    def look_up_batch(self, requests: Sequence[LookUp]) -> list[Rows]:
        rows = super().look_up_batch(requests)  # recorded, and held at the gate
        if self.poison is not None and any(self.poison in r.ids.values() for r in requests):
            raise RuntimeError(f"injected onnxruntime failure (batch holds id {self.poison})")
        return rows


class PoisonLoader:
    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.backend: PoisonBackend | None = None

    def __call__(self, directory: Path, settings: Settings) -> LoadedModel:
        loaded = load_model(directory, settings)
        self.backend = PoisonBackend(loaded.backend, self.gate)
        return dataclasses.replace(loaded, backend=self.backend)
