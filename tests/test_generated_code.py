"""The committed protocol code is what the one recipe generates from the .proto now."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "protos" / "tokembed" / "v1"
GENERATED_FILES = [
    "embedding_pb2.py",
    "embedding_pb2.pyi",
    "embedding_pb2_grpc.py",
    "embedding_pb2_grpc.pyi",
]


def load_recipe() -> ModuleType:
    path = ROOT / "scripts" / "gen_protos.py"
    spec = importlib.util.spec_from_file_location("tokembed_gen_protos", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("protos")
    load_recipe().generate(out)
    return out / "tokembed" / "v1"


@pytest.mark.parametrize("name", GENERATED_FILES)
def test_committed_generated_file_is_up_to_date(regenerated: Path, name: str) -> None:
    fresh = regenerated / name
    assert fresh.is_file(), f"the recipe no longer writes {name}"
    committed = COMMITTED / name
    assert committed.is_file(), f"{name} is not committed beside the .proto"
    assert committed.read_bytes() == fresh.read_bytes(), (
        f"protos/tokembed/v1/{name} is stale: run `python scripts/gen_protos.py` and commit"
    )


def test_recipe_writes_nothing_unexpected(regenerated: Path) -> None:
    # A new generated file (say, another .proto) must be committed and checked here too.
    written = sorted(p.name for p in regenerated.iterdir() if p.is_file())
    assert written == sorted(GENERATED_FILES)
