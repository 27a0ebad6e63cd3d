"""Write the KServe CRD schemas tests/deploy checks deploy/kserve against, from KServe's CRDs.

    python scripts/kserve_schemas.py SERVINGRUNTIMES_CRD INFERENCESERVICES_CRD SOURCE

SERVINGRUNTIMES_CRD and INFERENCESERVICES_CRD are KServe's
``config/crd/full/serving.kserve.io_{servingruntimes,inferenceservices}.yaml``, SOURCE says
where they came from (repository and commit: it is written into the files). The full
CRDs are large, most of it Kubernetes' own types (containers, volumes, affinity) copied
in. Those subtrees are cut to stubs here, and tests/deploy/test_kserve.py checks
those parts with kubernetes-validate instead (a Pod made of the runtime's containers, as
KServe makes it); what is left is KServe's own structure, made strict (an unknown field is
an error, as ``kubectl apply --validate=strict`` makes it) so that a misspelt field fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

OUT = Path(__file__).resolve().parents[1] / "tests" / "deploy" / "schemas"
# A subtree larger than this (as JSON) is a Kubernetes type copied in: cut to a stub...
LIMIT_CHARS = 3000
# ...unless it is on the way to the fields deploy/kserve uses.
KEEP = {
    (),
    ("spec",),
    ("spec", "predictor"),
    ("spec", "predictor", "model"),
}


def trim(node: dict[str, Any], path: tuple[str, ...] = ()) -> dict[str, Any]:
    if path not in KEEP and len(json.dumps(node)) > LIMIT_CHARS:
        return _stub(node)
    out = dict(node)
    out.pop("description", None)
    if "properties" in out:
        out["properties"] = {k: trim(v, (*path, k)) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    if isinstance(out.get("items"), dict):
        out["items"] = trim(out["items"], (*path, "[]"))
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = trim(out["additionalProperties"], (*path, "*"))
    return out


def _stub(node: dict[str, Any]) -> dict[str, Any]:
    kind = node.get("type", "object")
    stub: dict[str, Any] = {"type": kind, "x-tokembed": "a Kubernetes type: kubernetes-validate"}
    if kind == "array":
        stub["items"] = {}
    return stub


def schema_of(crd_path: Path, version: str, source: str) -> dict[str, Any]:
    crd = yaml.safe_load(crd_path.read_text())
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return {
        "x-source": f"{source} {crd_path.name}, version {version}, trimmed by "
        "scripts/kserve_schemas.py",
        "x-kind": crd["spec"]["names"]["kind"],
        "x-api-version": f"{crd['spec']['group']}/{version}",
        **trim(entry["schema"]["openAPIV3Schema"]),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    runtimes, services, source = Path(argv[0]), Path(argv[1]), argv[2]
    OUT.mkdir(parents=True, exist_ok=True)
    for name, path, version in (
        ("kserve-servingruntime.json", runtimes, "v1alpha1"),
        ("kserve-inferenceservice.json", services, "v1beta1"),
    ):
        text = json.dumps(schema_of(path, version, source), indent=1, sort_keys=True) + "\n"
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name} ({len(text)} characters)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
