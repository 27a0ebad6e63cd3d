"""The rooms keep their walls: every module imports only what its room's row of
docs/architecture.md's table allows ("may import"). ``ROOMS`` below is that table as the
check reads it; ``test_the_rooms_are_the_documented_ones`` keeps the two naming the same
rooms. gRPC and the wire stay in server/edge and the server's top (which wires the rooms
together), so a second protocol sits beside edge/v1/ without touching what is below; the
backends know no model directory; the client and the contract of a model directory
never load torch nor onnxruntime.

The standard library is open to every room. A module is told by where its file is, so a
new module is checked without being named here; a new package is a new room, which must
be given a row (``test_every_module_is_in_a_room``)."""

from __future__ import annotations

import ast
import pkgutil
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import tokembed
import tokembed.cli
import tokembed.client
import tokembed.export
import tokembed.server

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
# The package's version (protos/tokembed/__init__.py) is every room's to read.
VERSION = "tokembed.__version__"
# The model directory's contract, and what it rests on: no torch, no onnxruntime.
CONTRACT = ("manifest", "kinds", "model_dir", "errors", "hashing")
GRPC = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf")
# Packages that are not rooms of the server and its library: the benchmarks drive the
# server and the client from outside.
NOT_ROOMS = {"bench"}


@dataclass(frozen=True)
class Room:
    name: str  # as docs/architecture.md's table names it
    package: str  # where its modules are, sub-packages included
    may_import: tuple[str, ...]  # modules and packages (each with what is inside it)
    modules: tuple[str, ...] = ()  # only these modules of the package; () every other one
    also: str = ""  # which part of the room, where the table's row has two

    @property
    def label(self) -> str:
        return f"{self.name} {self.also}".strip()


def _export(*modules: str) -> tuple[str, ...]:
    return tuple(f"tokembed.export.{module}" for module in modules)


ROOMS = (
    Room("protos/", "tokembed", may_import=(*GRPC, "tokembed.v1", "tokembed.v2")),
    Room(
        "export/",
        "tokembed.export",
        may_import=("numpy", "onnx", *_export(*CONTRACT)),
        modules=CONTRACT,
        also="(the contract)",
    ),
    Room(
        "export/",
        "tokembed.export",
        may_import=(
            *("numpy", "ml_dtypes", "onnx", "onnxruntime", "torch", "safetensors"),
            *(VERSION, "tokembed.export"),
        ),
        also="(the exporter)",
    ),
    Room(
        "server/edge/",
        "tokembed.server.edge",
        may_import=(
            *GRPC,
            *("numpy", VERSION, "tokembed.v1", "tokembed.v2"),
            *("tokembed.server.edge", "tokembed.server.core"),
            *_export("manifest", "kinds"),
        ),
    ),
    Room(
        "server/core/",
        "tokembed.server.core",
        may_import=(
            *("numpy", "ml_dtypes", "tokembed.server.core", "tokembed.server.backends"),
            *_export("manifest", "kinds", "model_dir", "errors"),
        ),
    ),
    Room(
        "server/backends/",
        "tokembed.server.backends",
        may_import=(
            *("numpy", "ml_dtypes", "onnx", "onnxruntime", "tokembed.server.backends"),
            *(f"tokembed.server.core.{module}" for module in ("dtypes", "types", "errors")),
        ),
    ),
    Room(
        "server/ top",
        "tokembed.server",
        may_import=(
            *GRPC,
            *("prometheus_client", "numpy", "ml_dtypes", "onnx", "onnxruntime", VERSION),
            *("tokembed.v1", "tokembed.v2", "tokembed.server", "tokembed.export"),
        ),
    ),
    Room(
        "client/",
        "tokembed.client",
        may_import=(
            *("grpc", "grpc_health", "google.protobuf", "numpy", "ml_dtypes", VERSION),
            *("tokembed.v1", "tokembed.v2", "tokembed.client"),
        ),
    ),
    Room(
        "cli/",
        "tokembed.cli",
        may_import=(
            *("numpy", VERSION, "tokembed.cli", "tokembed.client"),
            *("tokembed.export.errors", "tokembed.server.core.errors"),
        ),
    ),
)


def _package_dir(package: str) -> Path:
    return Path(sys.modules[package].__file__ or "").resolve().parent


def _module_name(path: Path) -> str:
    for package in sorted({room.package for room in ROOMS}, key=len, reverse=True):
        top = _package_dir(package)
        if top in path.parents:
            parts = path.relative_to(top).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            return ".".join((package, *parts))
    raise AssertionError(f"{path} is in no room's package")


def _imports(path: Path, module: str | None = None) -> set[str]:
    """Every name ``path`` imports, anywhere in it (functions and TYPE_CHECKING blocks
    included): ``import a.b`` is "a.b", ``from a import b`` "a.b" (b a module or not).
    ``module``: the module's own name, to resolve relative imports."""
    names: set[str] = set()
    package = (module or "").split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                assert module is not None, f"{path}: a relative import"
                base = ".".join([*package[: len(package) - node.level + 1], *filter(None, [base])])
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _inside(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def _forbidden(names: set[str], room: Room) -> list[str]:
    return sorted(
        name
        for name in names
        if name.split(".")[0] not in sys.stdlib_module_names
        and name != "__future__.annotations"
        and not _inside(name, room.may_import)
    )


def _room_of(path: Path) -> Room:
    """The narrowest room whose package holds ``path`` (a part of a room first)."""
    holding = [
        room
        for room in ROOMS
        if _package_dir(room.package) in path.parents
        and (not room.modules or _module_name(path).rsplit(".", 1)[-1] in room.modules)
    ]
    assert holding, f"{path} is in no room"
    return max(holding, key=lambda room: (room.package.count("."), bool(room.modules)))


def _modules() -> list[Path]:
    found: set[Path] = set()
    for room in ROOMS:
        found.update(_package_dir(room.package).rglob("*.py"))
    return sorted(found)


def test_every_module_is_in_a_room() -> None:
    packages = {info.name for info in pkgutil.iter_modules(tokembed.__path__) if info.ispkg}
    rooms = {room.package.split(".")[1] for room in ROOMS if room.package != "tokembed"}
    assert packages - NOT_ROOMS == rooms | {"v1", "v2"}
    where = {str(path.relative_to(_package_dir("tokembed").parents[1])): _room_of(path).label
             for path in _modules()}  # fmt: skip
    # The walk found the rooms, sub-packages included, each module in its own.
    assert where["server/core/operations/embed.py"] == "server/core/"
    assert where["server/edge/v1/servicer.py"] == "server/edge/"
    assert where["server/backends/table.py"] == "server/backends/"
    assert where["server/metrics.py"] == "server/ top"
    assert where["export/model_dir.py"] == "export/ (the contract)"
    assert where["export/onnx_export.py"] == "export/ (the exporter)"
    assert where["protos/tokembed/v1/embedding_pb2_grpc.py"] == "protos/"
    assert where["client/aio.py"] == "client/"
    assert where["cli/main.py"] == "cli/"


@pytest.mark.parametrize("room", ROOMS, ids=[room.label for room in ROOMS])
def test_a_room_imports_only_what_its_row_allows(room: Room) -> None:
    checked = [path for path in _modules() if _room_of(path) == room]
    assert checked, room
    top = _package_dir("tokembed").parents[1]
    offenders = {
        str(path.relative_to(top)): _forbidden(_imports(path, _module_name(path)), room)
        for path in checked
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_rooms_are_the_documented_ones() -> None:
    """The first column of docs/architecture.md's table of rooms names the rooms here."""
    text = DOC.read_text()
    table = text[text.index("## The rooms") :].split("\n\n")[1]
    documented = [
        re.sub(r"\s*\(.*", "", row.split("|")[1].replace("`", "").strip())
        for row in table.splitlines()[2:]
    ]
    assert documented == list(dict.fromkeys(room.name for room in ROOMS))


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from tokembed import __version__, v1\n"
        "def f():\n"
        "    import grpc.aio\n"
        "    from tokembed.server import settings\n"
        "    from tokembed.server.core.dtypes import DType\n"
    )
    names = _imports(module)
    assert names == {"tokembed.__version__", "tokembed.v1", "grpc.aio",
                     "tokembed.server.settings", "tokembed.server.core.dtypes.DType"}  # fmt: skip
    backends = next(room for room in ROOMS if room.name == "server/backends/")
    assert _forbidden(names, backends) == [
        "grpc.aio", "tokembed.__version__", "tokembed.server.settings", "tokembed.v1"
    ]  # fmt: skip
    relative = tmp_path / "r.py"
    relative.write_text("from ..core import dtypes\nfrom . import table\n")
    assert _imports(relative, "tokembed.server.backends.r") == {
        "tokembed.server.core.dtypes", "tokembed.server.backends.table"
    }  # fmt: skip
