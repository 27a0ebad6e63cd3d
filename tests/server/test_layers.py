"""The rooms keep their walls: every module imports only what its room's row of
docs/architecture.md's table allows ("may import"). ``ROOMS`` below is that table as the
check reads it; ``test_the_rooms_are_the_documented_ones`` keeps the two naming the same
rooms. gRPC and the wire stay in server/edge and the server's top (which wires the rooms
together), so a second protocol sits beside edge/v1/ without touching what is below; the
backends know no model directory; the client and the contract of a model directory
never load torch nor onnxruntime.

The standard library is open to every room. A module is told by where its file is, so a
new module is checked without being named here; a new package beside them is a new room,
which must be given a row (``test_every_module_is_in_a_room``)."""

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
CONTRACT = ("manifest", "kinds", "model_dir", "dtypes", "errors", "hashing")
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
    # Imported only where used (in a function, or for the type checker), never with the
    # module itself.
    deferred: tuple[str, ...] = ()
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
        may_import=("numpy", "ml_dtypes", "onnx", *_export(*CONTRACT)),
        modules=CONTRACT,
        deferred=("torch",),  # a torch dtype, which the exporter alone asks for
        also="(the contract)",
    ),
    Room(
        "export/",
        "tokembed.export",
        may_import=(
            *("numpy", "ml_dtypes", "onnx", "onnxruntime", "torch", "safetensors", "tokenizers"),
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
            *_export("manifest", "kinds", "model_dir", "dtypes", "errors"),
        ),
    ),
    Room(
        "server/backends/",
        "tokembed.server.backends",
        may_import=(
            *("numpy", "ml_dtypes", "onnx", "onnxruntime", "tokenizers"),
            "tokembed.server.backends",
            *(f"tokembed.server.core.{module}" for module in ("dtypes", "types", "errors")),
        ),
    ),
    Room(
        "server/models/",
        "tokembed.server.models",
        may_import=(
            *("numpy", VERSION, "tokembed.export", "tokembed.server.models"),
            *("tokembed.server.core", "tokembed.server.backends"),
            "tokembed.server.process.settings",
        ),
    ),
    Room(
        "server/observability/",
        "tokembed.server.observability",
        may_import=(
            *("prometheus_client", "tokembed.server.observability"),
            *("tokembed.server.core.calls", "tokembed.server.core.control"),
        ),
    ),
    Room(
        "server/process/",
        "tokembed.server.process",
        may_import=(
            "tokembed.server.process",
            *(f"tokembed.server.core.{module}" for module in ("dtypes", "errors")),
        ),
        # What a started process runs: the server, its logs, the default model.
        deferred=(
            "tokembed.server.app",
            "tokembed.server.observability.logs",
            "tokembed.server.models.default_model",
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
        deferred=("torch",),  # engine-ready answers (client/engines.py), an optional extra
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


def _modules() -> dict[str, Path]:
    """Every module of the rooms' packages, by name, sub-packages included."""
    found: dict[str, Path] = {}
    for package in {room.package for room in ROOMS}:
        top = Path(sys.modules[package].__file__ or "").resolve().parent
        for path in top.rglob("*.py"):
            parts = path.relative_to(top).with_suffix("").parts
            found[".".join((package, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return dict(sorted(found.items()))


def _imports(path: Path, module: str | None = None, *, deferred: bool = True) -> set[str]:
    """Every name ``path`` imports: ``import a.b`` is "a.b", ``from a import b`` "a.b" (b a
    module or not). ``deferred``: those in functions and for the type checker too (else
    only what importing the module imports). ``module``: the module's own name, to resolve
    relative imports."""
    names: set[str] = set()
    package = (module or "").split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    nodes: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                assert module is not None, f"{path}: a relative import"
                base = ".".join([*package[: len(package) - node.level + 1], *filter(None, [base])])
            names.update(f"{base}.{alias.name}" for alias in node.names)
        if deferred:
            nodes.extend(ast.iter_child_nodes(node))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            nodes.extend(node.orelse)
        else:
            nodes.extend(ast.iter_child_nodes(node))
    return names


def _inside(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def _forbidden(path: Path, module: str | None, room: Room) -> list[str]:
    eager = _imports(path, module, deferred=False)
    return sorted(
        name
        for name in _imports(path, module)
        if name.split(".")[0] not in sys.stdlib_module_names
        and name != "__future__.annotations"
        and not _inside(name, room.may_import)
        and not (_inside(name, room.deferred) and name not in eager)
    )


def _room_of(module: str) -> Room:
    """The narrowest room whose package holds ``module`` (a part of a room first)."""
    holding = [
        room
        for room in ROOMS
        if _inside(module, (room.package,))
        and (not room.modules or module in {f"{room.package}.{name}" for name in room.modules})
    ]
    assert holding, f"{module} is in no room"
    return max(holding, key=lambda room: (room.package.count("."), bool(room.modules)))


def test_every_module_is_in_a_room() -> None:
    packages = {info.name for info in pkgutil.iter_modules(tokembed.__path__) if info.ispkg}
    rooms = {room.package.split(".")[1] for room in ROOMS if room.package != "tokembed"}
    assert packages - NOT_ROOMS == rooms | {"v1", "v2"}
    where = {module: _room_of(module).label for module in _modules()}
    # The walk found the rooms, sub-packages included, each module in its own.
    assert {
        module: where[f"tokembed.{module}"]
        for module in ("server.core.operations.embed", "server.edge.v1.servicer",
                       "server.backends.table", "server.observability.metrics", "server.app",
                       "server.process.settings", "server.models.loading", "export.model_dir",
                       "export.pipeline", "v1.embedding_pb2_grpc", "client.aio", "cli.main")
    } == {
        "server.core.operations.embed": "server/core/",
        "server.edge.v1.servicer": "server/edge/",
        "server.backends.table": "server/backends/",
        "server.observability.metrics": "server/observability/",
        "server.app": "server/ top",
        "server.process.settings": "server/process/",
        "server.models.loading": "server/models/",
        "export.model_dir": "export/ (the contract)",
        "export.pipeline": "export/ (the exporter)",
        "v1.embedding_pb2_grpc": "protos/",
        "client.aio": "client/",
        "cli.main": "cli/",
    }  # fmt: skip


@pytest.mark.parametrize("room", ROOMS, ids=[room.label for room in ROOMS])
def test_a_room_imports_only_what_its_row_allows(room: Room) -> None:
    checked = {module: path for module, path in _modules().items() if _room_of(module) == room}
    assert checked, room
    offenders = {module: _forbidden(path, module, room) for module, path in checked.items()}
    assert {module: names for module, names in offenders.items() if names} == {}


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
        "    from tokembed.server.process import settings\n"
        "    from tokembed.server.core.dtypes import DType\n"
    )
    assert _imports(module) == {
        "tokembed.__version__", "tokembed.v1", "grpc.aio", "tokembed.server.process.settings",
        "tokembed.server.core.dtypes.DType",
    }  # fmt: skip
    backends = next(room for room in ROOMS if room.name == "server/backends/")
    assert _forbidden(module, None, backends) == [
        "grpc.aio", "tokembed.__version__", "tokembed.server.process.settings", "tokembed.v1"
    ]  # fmt: skip
    relative = tmp_path / "r.py"
    relative.write_text("from ..core import dtypes\nfrom . import table\n")
    assert _imports(relative, "tokembed.server.backends.r") == {
        "tokembed.server.core.dtypes", "tokembed.server.backends.table"
    }  # fmt: skip


def test_a_deferred_import_is_told_from_one_the_module_makes(tmp_path: Path) -> None:
    """The contract of a model directory may ask torch for a dtype in a function; it may
    not import torch with itself."""
    contract = next(room for room in ROOMS if room.deferred)
    deferred = tmp_path / "deferred.py"
    deferred.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import torch\n"
        "def f():\n    import torch\n"
    )
    assert _forbidden(deferred, None, contract) == []
    for eager in ("import torch\n", "class C:\n    import torch.nn\n"):
        (tmp_path / "eager.py").write_text(eager)
        assert _forbidden(tmp_path / "eager.py", None, contract) != [], eager
