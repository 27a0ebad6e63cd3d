"""deploy/kserve: the ServingRuntime and the InferenceServices, checked as far as offline
tools allow.

- KServe's own structure against KServe's CRD schemas (tests/deploy/schemas, cut from
  KServe's CRDs by scripts/kserve_schemas.py: the source is named in each file), strictly:
  a field the CRD does not have fails.
- The Kubernetes parts (the containers, their probes, resources and security context)
  against Kubernetes' schemas with kubernetes-validate, as the Pod KServe makes of them:
  the runtime's container with the InferenceService's model fields merged in.
- What they say against the server: every TOKEMBED_* variable is a real setting and
  parses; the ports, probes, model directory and protocol agree with it.

No cluster here: that KServe schedules these and routes V2 calls to them is not shown.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploy_files import DEPLOY, ROOT, env_of, parse_dockerfile, settings_from_env

KSERVE = DEPLOY / "kserve"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
K8S_SCHEMA_VERSIONS = ("1.25.0", "1.37.0")
STORAGE_DIR = "/mnt/models"  # where KServe's storage initializer puts a storageUri


def load(name: str) -> dict[str, Any]:
    (doc,) = list(yaml.safe_load_all((KSERVE / name).read_text()))
    return doc  # type: ignore[no-any-return]


def runtime() -> dict[str, Any]:
    return load("servingruntime.yaml")


def services() -> dict[str, dict[str, Any]]:
    return {name: load(name) for name in ("inferenceservice.yaml", "inferenceservice-baked.yaml")}


def crd_check(doc: dict[str, Any]) -> None:
    name = {"ServingRuntime": "kserve-servingruntime.json",
            "InferenceService": "kserve-inferenceservice.json"}[doc["kind"]]  # fmt: skip
    schema = json.loads((SCHEMAS / name).read_text())
    assert doc["apiVersion"] == schema["x-api-version"]
    assert doc["kind"] == schema["x-kind"]
    jsonschema.Draft7Validator(schema).validate(doc)


def env_dict(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def pod_of(service: dict[str, Any]) -> dict[str, Any]:
    """The Pod KServe makes for ``service``: the runtime's container with the model's
    container fields merged in (env by name, the model's resources over the runtime's)."""
    (container,) = copy.deepcopy(runtime()["spec"]["containers"])
    model = service["spec"]["predictor"]["model"]
    merged = {**env_dict(container), **env_dict(model)}
    container["env"] = [{"name": k, "value": v} for k, v in merged.items()]
    if "resources" in model:
        container["resources"] = model["resources"]
    volumes: list[dict[str, Any]] = []
    if "storageUri" in model:
        container["volumeMounts"] = [{"name": "kserve-provision-location",
                                      "mountPath": STORAGE_DIR, "readOnly": True}]  # fmt: skip
        volumes = [{"name": "kserve-provision-location", "emptyDir": {}}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": service["metadata"]["name"],
            "annotations": runtime()["spec"]["annotations"],
        },
        "spec": {"containers": [container], "volumes": volumes},
    }


@pytest.mark.parametrize("name", ["servingruntime.yaml", "inferenceservice.yaml",
                                  "inferenceservice-baked.yaml"])  # fmt: skip
def test_each_resource_validates_against_kserve_s_crd(name: str) -> None:
    crd_check(load(name))


def test_the_crd_check_refuses_a_misspelt_field() -> None:
    """The check above can fail: KServe's structure is checked strictly."""
    service = services()["inferenceservice.yaml"]
    model = service["spec"]["predictor"]["model"]
    model["protocolversion"] = model.pop("protocolVersion")
    with pytest.raises(jsonschema.ValidationError, match="protocolversion"):
        crd_check(service)
    broken = runtime()
    broken["spec"]["supportedModelFormats"][0]["autoSelect"] = "yes"
    with pytest.raises(jsonschema.ValidationError, match="'yes' is not of type 'boolean'"):
        crd_check(broken)


@pytest.mark.parametrize("name", ["inferenceservice.yaml", "inferenceservice-baked.yaml"])
def test_the_pods_kserve_makes_validate_against_the_kubernetes_schemas(name: str) -> None:
    pod = pod_of(services()[name])
    for version in K8S_SCHEMA_VERSIONS:
        kubernetes_validate.validate(pod, version, strict=True)
    broken = copy.deepcopy(pod)
    container = broken["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(broken, K8S_SCHEMA_VERSIONS[-1], strict=True)


def test_the_runtime_points_at_the_server() -> None:
    spec = runtime()["spec"]
    assert spec["protocolVersions"] == ["grpc-v2"]
    (container,) = spec["containers"]
    assert container["name"] == "kserve-container"
    env = env_dict(container)
    settings = settings_from_env({k: v for k, v in env.items() if k != "TOKEMBED_TARGET"})
    assert settings.host == "0.0.0.0" and settings.metrics_host == "0.0.0.0"
    assert env["TOKEMBED_TARGET"] == f"127.0.0.1:{settings.port}", "`tokembed health`'s target"
    # KServe sends gRPC to the port named h2c; the server's gRPC port, probes on it.
    assert container["ports"] == [{"name": "h2c", "containerPort": settings.port,
                                   "protocol": "TCP"}]  # fmt: skip
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == settings.port, probe
    assert settings.model_dir == (Path(STORAGE_DIR),)
    annotations = spec["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == settings.metrics_port
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    from tokembed.bench.plan import DEPLOYMENT_ENV

    assert env["GLIBC_TUNABLES"] == DEPLOYMENT_ENV["GLIBC_TUNABLES"]


def test_the_services_name_the_runtime_and_where_their_model_comes_from() -> None:
    formats = {(f["name"], f["version"]) for f in runtime()["spec"]["supportedModelFormats"]}
    baked_dir = env_of(parse_dockerfile(ROOT / "Dockerfile").stages[-1])["TOKEMBED_MODEL_DIR"]
    for name, service in services().items():
        assert service["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == (
            "RawDeployment"
        )
        model = service["spec"]["predictor"]["model"]
        assert model["runtime"] == runtime()["metadata"]["name"]
        assert model["protocolVersion"] == "grpc-v2"
        assert (model["modelFormat"]["name"], model["modelFormat"]["version"]) in formats
        merged = env_dict(pod_of(service)["spec"]["containers"][0])
        settings = settings_from_env({k: v for k, v in merged.items() if k != "TOKEMBED_TARGET"})
        if name == "inferenceservice.yaml":
            assert model["storageUri"].split("://")[0] in {"pvc", "s3", "gs", "https"}
            assert settings.model_dir == (Path(STORAGE_DIR),)
        else:  # the image's own model, where the Dockerfile copies it
            assert "storageUri" not in model
            assert settings.model_dir == (Path(baked_dir),)
