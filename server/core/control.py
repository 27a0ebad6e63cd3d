"""What a front end may ask of the control plane (``server/models/control_plane.py``, which owns
the set of models and their lifecycle): the repository's index, a model's load and its
unload. Here so that the edge, which may not import the server's top, names it.

The states are the Open Inference Protocol's (Triton's model repository extension):
``UNAVAILABLE`` (on disk, not served: never loaded, unloaded, or a load that failed, with
its reason), ``LOADING``, ``READY``, ``UNLOADING`` (no new requests; those admitted
finish on it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

UNAVAILABLE = "UNAVAILABLE"
LOADING = "LOADING"
READY = "READY"
UNLOADING = "UNLOADING"


@dataclass(frozen=True)
class IndexEntry:
    """One model version as the index tells it ("" version: a model with no version)."""

    name: str
    version: str
    state: str
    reason: str = ""


class ModelControl(Protocol):
    def index(self, *, ready_only: bool = False) -> list[IndexEntry]:
        """Every model in the repository (and every model served), each version."""
        ...

    async def load(
        self, name: str, *, config: Mapping[str, Any] | None = None, force: bool = False
    ) -> None:
        """Load ``name``'s versions (by its version policy, or ``config``'s) and serve
        them once ready; return once they serve. Raises a ``core.errors`` error naming
        the fault (``LoadFailed``: what served before serves still)."""
        ...

    async def unload(self, name: str) -> None:
        """Stop serving ``name``: new requests are refused at once, admitted ones finish
        (within the grace) before its versions are let go."""
        ...
