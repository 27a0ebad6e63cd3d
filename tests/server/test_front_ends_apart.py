"""The two front ends stand side by side: neither imports the other. What gRPC front ends
share lives in server/edge itself (the sinks, the wire format's pieces, the status tables'
mechanism), so a third protocol takes it from there, not from tokembed.v1's front end."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tokembed.server.edge

EDGE = Path(tokembed.server.edge.__file__).resolve().parent
FRONT_ENDS = {"v1": "tokembed.server.edge.v1", "v2": "tokembed.server.edge.v2"}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, ``from a import b`` giving both ``a`` and ``a.b``
    (``b`` may be a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _leans_on(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize(("front_end", "other"), [("v1", "v2"), ("v2", "v1")])
def test_no_front_end_imports_the_other(front_end: str, other: str) -> None:
    modules = sorted((EDGE / front_end).rglob("*.py"))
    assert EDGE / front_end / "servicer.py" in modules  # the walk found the front end
    offenders = {
        str(path.relative_to(EDGE)): sorted(
            name for name in _imports(path) if _leans_on(name, FRONT_ENDS[other])
        )
        for path in modules
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_check_sees_either_form_of_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import tokembed.server.edge.v1.responses\n"
        "from tokembed.server.edge import v1\n"
        "def f():\n    from tokembed.server.edge.v1.servicer import GrpcUnarySink\n"
    )
    found = {name for name in _imports(module) if _leans_on(name, FRONT_ENDS["v1"])}
    assert found == {
        "tokembed.server.edge.v1.responses",
        "tokembed.server.edge.v1",
        "tokembed.server.edge.v1.servicer",
        "tokembed.server.edge.v1.servicer.GrpcUnarySink",
    }
