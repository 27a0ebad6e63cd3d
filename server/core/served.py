"""One served model version: what it is (its directory, kind and backend) and the limits
it is served under. Operations validate against it, GetModelInfo describes it, the
scheduler runs its backend."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokembed.export.kinds import IdInput, ModelKind
from tokembed.export.model_dir import ModelDir
from tokembed.server.backends.base import Backend


@dataclass(frozen=True)
class Limits:
    """Per request, whatever the model."""

    max_tokens_per_request: int
    max_output_bytes_per_request: int


@dataclass(frozen=True)
class BatchLimits:
    max_batch_tokens: int
    max_delay_s: float
    max_concurrent_batches: int
    max_queued_tokens: int


@dataclass(frozen=True)
class ServedModel:
    model: ModelDir
    backend: Backend
    limits: Limits
    batch: BatchLimits
    # Read per request: the kind's id inputs with their bounds, the primary one first.
    inputs: tuple[IdInput, ...] = field(init=False)
    bounds: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        inputs = self.model.kind.inputs(self.model.manifest)
        object.__setattr__(self, "inputs", inputs)
        object.__setattr__(self, "bounds", tuple(i.bound(self.model.manifest) for i in inputs))

    @property
    def name(self) -> str:
        return self.model.manifest.name

    @property
    def version(self) -> str:
        return self.model.manifest.version

    @property
    def kind(self) -> ModelKind:
        return self.model.kind

    @property
    def vocab_size(self) -> int:
        return self.model.manifest.vocab_size

    @property
    def d_model(self) -> int:
        return self.model.manifest.d_model
