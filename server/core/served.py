"""One served model version: what it is (its directory, kind and backend) and the limits
it is served under. Operations validate against it, GetModelInfo describes it, the
scheduler runs its backend."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokembed.export.kinds import IdInput, ModelKind
from tokembed.export.model_dir import ModelDir
from tokembed.server.backends.base import Backend
from tokembed.server.backends.tokenizer import TextTokenizer


@dataclass(frozen=True)
class Limits:
    """Per request, whatever the model."""

    max_tokens_per_request: int
    max_output_bytes_per_request: int
    # nearest: the largest k, and the work (2 N D V flops) of one request.
    max_nearest_k: int = 1024
    max_nearest_flops_per_request: int = 2**40


@dataclass(frozen=True)
class BatchLimits:
    max_batch_tokens: int
    max_delay_s: float
    max_concurrent_batches: int
    max_queued_tokens: int
    # nearest's batches: the vectors of one multiply; its queue: the work (2 N D V flops)
    # waiting, which admission bounds instead of its vectors.
    nearest_max_batch_rows: int = 256
    max_queued_nearest_flops: int = 2**42


@dataclass(frozen=True)
class ServedModel:
    model: ModelDir
    backend: Backend
    limits: Limits
    batch: BatchLimits
    # The model's own tokenizer (its directory's tokenizer.json), if it has one.
    tokenizer: TextTokenizer | None = None
    # What requests read, taken from the model directory once (plain attributes: no code
    # runs per request to read them).
    name: str = field(init=False)
    version: str = field(init=False)
    kind: ModelKind = field(init=False)
    vocab_size: int = field(init=False)
    d_model: int = field(init=False)
    # The kind's id inputs with their bounds, the primary one (input_ids) first.
    inputs: tuple[IdInput, ...] = field(init=False)
    bounds: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        manifest = self.model.manifest
        inputs = self.model.kind.inputs(manifest)
        derived = {
            "name": manifest.name,
            "version": manifest.version,
            "kind": self.model.kind,
            "vocab_size": manifest.vocab_size,
            "d_model": manifest.d_model,
            "inputs": inputs,
            "bounds": tuple(i.bound(manifest) for i in inputs),
        }
        for key, value in derived.items():
            object.__setattr__(self, key, value)
