"""System shared-memory regions made as a tritonclient user makes them, and a server that
takes them: shared by the V2 shared-memory tests."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import tritonclient.utils.shared_memory as shm

SHM_ROOT = Path("/dev/shm")

# make(suffix, byte_size) -> (region name, key, tritonclient's handle)
MakeRegion = Callable[[str, int], tuple[str, str, Any]]


@contextlib.contextmanager
def made_regions(prefix: str) -> Iterator[MakeRegion]:
    """Regions under ``prefix``, made with ``create_shared_memory_region`` (sparse:
    ``ftruncate``, nothing written); every one, and any object left under the prefix,
    removed at the end."""
    made: list[Any] = []

    def make(suffix: str, byte_size: int) -> tuple[str, str, Any]:
        name = f"{prefix}_{suffix}"
        handle = shm.create_shared_memory_region(name, f"/{name}", byte_size, create_only=True)
        made.append(handle)
        return name, f"/{name}", handle

    try:
        yield make
    finally:
        for handle in made:
            with contextlib.suppress(Exception):
                shm.destroy_shared_memory_region(handle)
        for path in SHM_ROOT.glob(f"{prefix}*"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def serve(start_server: Any, model_dir: Path, prefix: str, **settings: Any) -> Any:
    """A server with system shared memory on, taking objects under ``prefix``."""
    return start_server(model_dir, shared_memory="system", shared_memory_prefix=prefix, **settings)
