"""Model kinds: what a model directory holds, as the manifest's ``kind`` names it.

A kind says which id inputs a request carries (each bounded by a manifest field) and which
tables the graph must hold. The exporter writes it, the loader (``model_dir``) checks the
graph against it, and the server's validation and backends read it; none of them assumes
one input and one table.

The kinds:

- ``token``: ``E [V, D]`` and ``x = E[id] * scale`` (the original Transformer's layer).
- ``segment``: BERT's, a second table ``S [T, D]`` of token types: ``x = E[id] * scale +
  S[t]``, where requests may carry ``token_type_ids`` (``0 <= t < T``; absent: all 0).
- ``factorized``: ALBERT's, ``E [V, D']`` then a projection ``D' -> D`` (a bias when the
  checkpoint has one): ``x = P(E[id] * scale)``.

A new kind is a ``ModelKind`` here, a graph the exporter writes for it, and a backend
that computes it (``tokembed.server.models.loading``). Manifests written before kinds existed
have no ``kind``: they are ``token`` models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokembed.export.errors import ModelDirError

if TYPE_CHECKING:
    from tokembed.export.manifest import Manifest

TOKEN = "token"
SEGMENT = "segment"
FACTORIZED = "factorized"
# A segment model's second input, as BERT (and its tokenizers) name it.
TOKEN_TYPE_IDS = "token_type_ids"


@dataclass(frozen=True)
class IdInput:
    """An input of ids: its graph and request name, and the manifest field its ids stay
    below (``vocab_size``: ``0 <= id < V``)."""

    name: str
    bound_field: str
    # An input a request may leave out; absent, every id is 0 (BERT's token types).
    optional: bool = False

    def bound(self, manifest: Manifest) -> int:
        value = getattr(manifest, self.bound_field)
        assert isinstance(value, int), "This is a bug."
        return value


@dataclass(frozen=True)
class TableShape:
    """A 2-D initializer the graph must hold: its manifest role and ``[rows, cols]``."""

    role: str
    shape: tuple[int, int]


@dataclass(frozen=True)
class ModelKind:
    name: str
    # The manifest's optional sizes (``Manifest.type_vocab_size``, ``factor_dim``) this
    # kind needs; a manifest must give these, positive, and none of the others.
    sizes: tuple[str, ...] = ()

    def check(self, manifest: Manifest, where: str) -> None:
        """``ModelDirError`` naming the field when the manifest's sizes do not fit the kind."""
        for size in _KIND_SIZES:
            value = getattr(manifest, size)
            if size in self.sizes and value is None:
                raise ModelDirError(f"{where}: a {self.name} model needs field {size!r}")
            if size in self.sizes and value <= 0:
                raise ModelDirError(f"{where}: {size} must be positive, got {value}")
            if size not in self.sizes and value is not None:
                raise ModelDirError(f"{where}: field {size!r} is not one a {self.name} model has")

    def inputs(self, manifest: Manifest) -> tuple[IdInput, ...]:
        """The id inputs, the primary one (``input_ids``) first."""
        return (IdInput(manifest.input.name, "vocab_size"),)

    def tables(self, manifest: Manifest) -> tuple[TableShape, ...]:
        """The 2-D tables the graph holds, by role."""
        return (TableShape("embedding", (manifest.vocab_size, manifest.d_model)),)


@dataclass(frozen=True)
class SegmentKind(ModelKind):
    """BERT's: ``E[id] * scale + S[t]``; ``token_type_ids`` below ``type_vocab_size``."""

    sizes: tuple[str, ...] = ("type_vocab_size",)

    def inputs(self, manifest: Manifest) -> tuple[IdInput, ...]:
        return (
            IdInput(manifest.input.name, "vocab_size"),
            IdInput(TOKEN_TYPE_IDS, "type_vocab_size", optional=True),
        )

    def tables(self, manifest: Manifest) -> tuple[TableShape, ...]:
        types = manifest.type_vocab_size
        assert types is not None, "This is a bug: check() requires it."
        return (
            TableShape("embedding", (manifest.vocab_size, manifest.d_model)),
            TableShape("segment", (types, manifest.d_model)),
        )


@dataclass(frozen=True)
class FactorizedKind(ModelKind):
    """ALBERT's: ``E [V, D']``, projected to D (the graph holds the projection as
    ``[D', D]``, the transpose of a torch ``Linear``'s weight)."""

    sizes: tuple[str, ...] = ("factor_dim",)

    def tables(self, manifest: Manifest) -> tuple[TableShape, ...]:
        inner = manifest.factor_dim
        assert inner is not None, "This is a bug: check() requires it."
        return (
            TableShape("embedding", (manifest.vocab_size, inner)),
            TableShape("projection", (inner, manifest.d_model)),
        )


KINDS: dict[str, ModelKind] = {
    TOKEN: ModelKind(TOKEN),
    SEGMENT: SegmentKind(SEGMENT),
    FACTORIZED: FactorizedKind(FACTORIZED),
}

# The manifest's optional sizes, each needed by some kind.
_KIND_SIZES = ("type_vocab_size", "factor_dim")


def kind_of(manifest: Manifest, where: str = "manifest") -> ModelKind:
    """The kind a manifest names; ``ModelDirError`` for one this version does not know."""
    kind = KINDS.get(manifest.kind)
    if kind is None:
        raise ModelDirError(
            f"{where}: kind {manifest.kind!r} is not one this tokembed knows "
            f"({', '.join(sorted(KINDS))}); a newer tokembed exported it"
        )
    return kind
