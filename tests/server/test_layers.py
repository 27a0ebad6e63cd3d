"""The rooms' one rule: gRPC and the wire format stay in server/edge (its front ends, such
as edge/v1/, and what they share) and app.py, which wires the server together. Everything
below, the data plane and the rest of the core, the backends, loading, metrics, works on
domain types, so a second protocol can sit beside edge/v1/ without touching it."""

from __future__ import annotations

import ast
from pathlib import Path

import tokembed.server

SERVER = Path(tokembed.server.__file__).resolve().parent
# Where gRPC and the generated protobuf classes belong.
EDGE = {SERVER / "edge", SERVER / "app.py"}
FORBIDDEN = ("grpc", "tokembed.v1", "tokembed.v2", "tokembed.server.edge", "google.protobuf")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.add(node.module)
    return names


def _below_the_edge() -> list[Path]:
    return [
        path
        for path in sorted(SERVER.rglob("*.py"))
        if not any(path == room or room in path.parents for room in EDGE)
    ]


def test_nothing_below_the_edge_imports_grpc_or_the_wire_format() -> None:
    checked = _below_the_edge()
    # The walk found the rooms, sub-packages included, and left out only the edge.
    for module in ("core/dataplane.py", "core/scheduler.py", "core/operations/embed.py",
                   "backends/table.py", "metrics.py"):  # fmt: skip
        assert SERVER / module in checked, module
    servicer = SERVER / "edge" / "v1" / "servicer.py"
    assert servicer.exists() and servicer not in checked
    offenders = {
        str(path.relative_to(SERVER)): sorted(
            name for name in _imports(path) if name.startswith(FORBIDDEN)
        )
        for path in checked
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_check_sees_an_import_of_grpc(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    import grpc.aio\n    from tokembed.v1 import embedding_pb2\n")
    assert _imports(module) == {"grpc.aio", "tokembed.v1"}
