"""Print the requirements of the project and of the named extras, one per line.

The images install these first, in a layer of their own, and the project's code after
(``pip install --no-deps .``): a change to the code then reuses the cached layer that
holds onnxruntime and grpcio instead of downloading them again.

    python requirements.py pyproject.toml server    # base + [server]

Extras that name the project itself (``tokembed[server,export]``) are followed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    name = project["name"]
    optional = project.get("optional-dependencies", {})
    self_ref = re.compile(rf"^{re.escape(name)}\s*\[([^\]]+)\]\s*$")
    out: list[str] = list(project.get("dependencies", []))
    seen: set[str] = set()
    todo = list(extras)
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        if extra not in optional:
            raise SystemExit(f"{pyproject}: no extra named {extra!r}")
        for req in optional[extra]:
            match = self_ref.match(req)
            if match:
                todo.extend(part.strip() for part in match.group(1).split(","))
            elif req not in out:
                out.append(req)
    return out


if __name__ == "__main__":
    print("\n".join(requirements(Path(sys.argv[1]), sys.argv[2:])))
