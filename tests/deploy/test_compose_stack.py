"""`docker-compose up --build` for real: the server image and Prometheus under podman.

The route docs/deployment.md gives where no Docker engine runs ("Without a Docker engine:
podman"), on free loopback ports: docker-compose.yml plus
deploy/compose/podman-local.override.yml (host networking on loopback, local stand-in base
images), driven through deploy/docker-compose and podman's Docker-compatible socket:

1. the local base images (deploy/local-images/build.sh: built once per recipe, then found
   by their tags and reused);
2. a small model exported on the host, which the build bakes into the runtime image;
3. `up -d --build tokembed prometheus`, with a loop that runs the healthchecks (podman 4.3
   needs systemd for that); the image gets a tag of this run's own, so that runs in other
   checkouts on the machine cannot swap it, and is removed at the end (its build cache
   stays, so the next run rebuilds only what changed);
4. from the host, on loopback: Embed with the client, /metrics, Prometheus's API;
5. `stop` (the server drains and exits 0), `down -v`, and everything this test started
   is stopped by its id.

Grafana is not part of this run: its image cannot be pulled here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from deploy_files import (
    DASHBOARD,
    PODMAN_OVERRIDE,
    PROMETHEUS_DIR,
    ROOT,
    run,
    series_names,
    server_metric_families,
)

from support.metrics import matching, samples, scrape, total
from support.ports import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WRAPPER = ROOT / "deploy" / "docker-compose"
# The route's files, as docs/deployment.md sets them (COMPOSE_FILE, paths from ROOT).
COMPOSE_FILE = f"docker-compose.yml:{PODMAN_OVERRIDE}"
TEST_IMAGE = f"localhost/tokembed:deploy-test-{os.getpid()}"
SERVICES = ("tokembed", "prometheus")  # no grafana: its image cannot be had here
# Small, so that export and image build stay quick; the values are still checked exactly.
VOCAB_SIZE, D_MODEL, SEED = 4096, 64, 7
MODEL_NAME = "deploy-test"


def _wait_for(what: str, check: Any, timeout_s: float, interval_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (OSError, ValueError, KeyError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}; last: {last!r}")


def _http_get(url: str, timeout_s: float = 5) -> str:
    assert url.startswith("http://127.0.0.1:"), "tests talk to loopback only"
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return str(response.read().decode())


def _prometheus_query(port: int, query: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    answer = json.loads(_http_get(url))
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


class HealthcheckLoop:
    """`podman healthcheck run` every second for the project's running containers.

    podman 4.3 schedules healthchecks with systemd timers; without systemd nobody runs
    them and a container stays "starting" for ever.
    """

    def __init__(self, podman: str, project: str, env: dict[str, str]) -> None:
        self._podman, self._project, self._env = podman, project, env
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="healthchecks", daemon=True)

    def __enter__(self) -> HealthcheckLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the healthcheck loop did not stop"

    def _loop(self) -> None:
        label = f"label=com.docker.compose.project={self._project}"
        while not self._stop.wait(1.0):
            try:
                ids = run(
                    [self._podman, "ps", "-q", "--filter", label, "--filter", "status=running"],
                    env=self._env,
                    timeout=20,
                ).stdout.split()
                for cid in ids:
                    # Containers without a healthcheck answer with an error; that is fine.
                    run([self._podman, "healthcheck", "run", cid], env=self._env, timeout=20)
            except subprocess.TimeoutExpired:
                continue


@dataclass
class Stack:
    env: dict[str, str]
    podman: str
    compose: list[str]
    project: str
    image: str
    grpc_port: int
    metrics_port: int
    prometheus_port: int
    model_dir: Path

    def container_ids(self, service: str | None = None, all_states: bool = True) -> list[str]:
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        flags = ["-a"] if all_states else []
        out = run([self.podman, "ps", "-q", *flags, *filters], env=self.env, timeout=30)
        return out.stdout.split()

    def inspect(self, cid: str) -> dict[str, Any]:
        out = run([self.podman, "inspect", cid], env=self.env, timeout=30)
        assert out.returncode == 0, out.stderr
        data: dict[str, Any] = json.loads(out.stdout)[0]
        return data

    def logs(self, service: str) -> str:
        parts = []
        for cid in self.container_ids(service):
            out = run([self.podman, "logs", "--tail", "40", cid], env=self.env, timeout=30)
            parts.append(out.stdout + out.stderr)
        return "\n".join(parts)

    def compose_run(self, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
        return run([*self.compose, *args], env=self.env, cwd=ROOT, timeout=timeout_s)


def _requirements() -> str:
    podman, compose = shutil.which("podman"), shutil.which("docker-compose")
    if podman is None or compose is None:
        pytest.skip("podman and docker-compose are needed (.ci/run installs them)")
    return podman


def _ensure_base_images(env: dict[str, str]) -> None:
    """build.sh: nothing to do (a second) when the images of its recipe are there."""
    started = time.monotonic()
    out = run([str(ROOT / "deploy/local-images/build.sh")], env=env, timeout=600)
    if out.returncode == 2 and ("needs root" in out.stderr or "debootstrap" in out.stderr):
        pytest.skip(f"the local base images must be built: {out.stderr.strip()}")
    assert out.returncode == 0, f"building the local base images failed:\n{out.stderr[-3000:]}"
    print(f"local base images ready in {time.monotonic() - started:.0f}s")


def _export_model(out_dir: Path) -> None:
    cmd = [sys.executable, "-m", "tokembed.cli", "export", "--out", str(out_dir)]
    cmd += ["--vocab-size", str(VOCAB_SIZE), "--d-model", str(D_MODEL), "--seed", str(SEED)]
    cmd += ["--name", MODEL_NAME]
    out = run(cmd, timeout=180)
    assert out.returncode == 0, out.stderr


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    podman = _requirements()
    work = Path(tempfile.mkdtemp(prefix="tokembed-compose-"))  # short: holds a socket
    # The podman settings this machine needs (CONTAINERS.md); /etc stays untouched.
    (work / "containers.conf").write_text(
        '[containers]\ndefault_ulimits = []\n[engine]\nruntime = "runc"\n'
    )
    base_env = {**os.environ, "CONTAINERS_CONF": str(work / "containers.conf")}
    model_rel = Path("models") / f".deploy-test-{os.getpid()}"
    model_dir = ROOT / model_rel
    models_existed = model_dir.parent.exists()
    targets = work / "targets"
    targets.mkdir()
    # Bound only after the image build (minutes): below the ephemeral range (support.ports).
    ports = free_ports(3, below_ephemeral=True)
    project = f"tokembedtest{os.getpid()}"
    env = {
        **base_env,
        "DOCKER_HOST": f"unix://{work}/podman.sock",
        "COMPOSE_PROJECT_NAME": project,
        "COMPOSE_FILE": COMPOSE_FILE,
        "TOKEMBED_IMAGE": TEST_IMAGE,
        "MODEL_DIR": str(model_rel),
        "TOKEMBED_PORT": str(ports[0]),
        "TOKEMBED_METRICS_PORT": str(ports[1]),
        "TOKEMBED_PROMETHEUS_PORT": str(ports[2]),
        "TOKEMBED_PROMETHEUS_TARGETS": str(targets),
    }
    (targets / "tokembed.yml").write_text(f'- targets: ["127.0.0.1:{ports[1]}"]\n')
    stack = Stack(
        env=env,
        podman=podman,
        compose=[str(WRAPPER)],
        project=project,
        image=TEST_IMAGE,
        grpc_port=ports[0],
        metrics_port=ports[1],
        prometheus_port=ports[2],
        model_dir=model_dir,
    )
    service: subprocess.Popen[bytes] | None = None
    try:
        _ensure_base_images(base_env)
        _export_model(model_dir)
        service = subprocess.Popen(
            [podman, "system", "service", "--time=0", env["DOCKER_HOST"]],
            env=base_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_for("podman's socket", lambda: (work / "podman.sock").exists(), 30, 0.1)
        config = yaml.safe_load(stack.compose_run("config").stdout)
        assert config["services"]["tokembed"]["image"] == stack.image
        with HealthcheckLoop(podman, project, base_env):
            try:
                started = time.monotonic()
                up = stack.compose_run("up", "-d", "--build", *SERVICES, timeout_s=600)
                assert up.returncode == 0, f"{up.stdout[-4000:]}\n{up.stderr[-2000:]}"
                print(f"image built and stack up in {time.monotonic() - started:.0f}s")
                _wait_healthy(stack)
                print(f"stack up and healthy in {time.monotonic() - started:.0f}s")
                yield stack
            finally:
                _teardown(stack)
    finally:
        if service is not None:
            _stop_process(service)
        shutil.rmtree(model_dir, ignore_errors=True)
        if not models_existed and model_dir.parent.exists() and not any(model_dir.parent.iterdir()):
            model_dir.parent.rmdir()
        try:
            _remove_image(podman, base_env, TEST_IMAGE)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _wait_healthy(stack: Stack) -> None:
    (cid,) = stack.container_ids("tokembed")

    def healthy() -> bool:
        state = stack.inspect(cid)["State"]
        if state["Status"] != "running":
            raise AssertionError(f"tokembed is {state['Status']}:\n{stack.logs('tokembed')}")
        health = state.get("Health") or state.get("Healthcheck") or {}
        return bool(health.get("Status") == "healthy")

    try:
        _wait_for("the tokembed healthcheck to say healthy", healthy, 120)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{stack.logs('tokembed')}") from None


def _remove_image(podman: str, env: dict[str, str], image: str) -> None:
    """This run's image goes (its build cache stays: the next run reuses it)."""
    if run([podman, "image", "exists", image], env=env).returncode == 0:
        out = run([podman, "rmi", image], env=env, timeout=120)
        assert out.returncode == 0, f"could not remove {image}: {out.stderr}"


def _teardown(stack: Stack) -> None:
    """`down -v`; then remove by id anything of this project that is left."""
    down = stack.compose_run("down", "-v", "--remove-orphans", "--timeout", "20")
    for cid in stack.container_ids():
        run([stack.podman, "rm", "-f", "-t", "5", cid], env=stack.env, timeout=60)
    leftover = stack.container_ids()
    assert down.returncode == 0, down.stderr
    assert not leftover, f"containers left behind: {leftover}"


# --- the checks ---------------------------------------------------------------------------


def test_image_holds_no_torch_and_runs_as_non_root(stack: Stack) -> None:
    out = run([stack.podman, "image", "inspect", stack.image], env=stack.env, timeout=30)
    image = json.loads(out.stdout)[0]
    config = image["Config"]
    assert config["User"].split(":")[0] not in ("", "0", "root")
    assert config["Entrypoint"] == ["tokembed", "serve"]
    # podman keeps a docker-format image's HEALTHCHECK beside Config
    assert image["Healthcheck"]["Test"] == ["CMD", "tokembed", "health"]
    probe = (
        "import importlib.util as u, importlib.metadata as m; "
        "print(u.find_spec('torch') is None, sorted(d.metadata['Name'].lower() "
        "for d in m.distributions()))"
    )
    out = run(
        [stack.podman, "run", "--rm", "--network", "none", "--entrypoint", "python",
         stack.image, "-c", probe],
        env=stack.env,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    no_torch, packages = out.stdout.split(" ", 1)
    assert no_torch == "True", "torch is importable in the runtime image"
    assert "torch" not in packages and "onnxruntime" in packages and "tokembed" in packages


def test_embed_from_the_host_returns_the_models_values(stack: Stack) -> None:
    import onnxruntime as ort

    from tokembed.client import EmbeddingClient

    ids = np.array([[0, 1, 2, VOCAB_SIZE - 1], [17, 17, 4000, 5]], dtype=np.int64)
    # The expected values, from the same model directory run on the host.
    session = ort.InferenceSession(
        str(stack.model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    (expected,) = session.run(None, {session.get_inputs()[0].name: ids})
    client = EmbeddingClient(f"127.0.0.1:{stack.grpc_port}")
    try:
        got = client.embed(ids.tolist())
        alone = client.embed([[4000]])
    finally:
        client.close()
    assert got.shape == (2, 4, D_MODEL) and got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(alone[0, 0], got[1, 2])  # no context: same id, same vector
    assert not np.array_equal(got[1, 0], got[1, 3])
    target = f"127.0.0.1:{stack.grpc_port}"
    health = run([sys.executable, "-m", "tokembed.cli", "health", "--target", target], timeout=30)
    assert health.returncode == 0, health.stdout + health.stderr


def test_metrics_port_exports_every_metric_the_dashboard_queries(stack: Stack) -> None:
    from tokembed.client import EmbeddingClient

    client = EmbeddingClient(f"127.0.0.1:{stack.grpc_port}")
    try:
        client.embed([[1, 2, 3]])
    finally:
        client.close()
    text = scrape(stack.metrics_port)
    scraped = {name for name, _ in samples(text)}
    dashboard = DASHBOARD.read_text()
    wanted = {
        name
        for name in series_names(server_metric_families())
        if name.startswith("tokembed_") and f"{name}{{" in dashboard
    }
    assert wanted, "the dashboard queries no tokembed metric?"
    assert wanted <= scraped, f"missing from a real scrape: {sorted(wanted - scraped)}"
    (info,) = matching(text, "tokembed_model_info")
    want = {"name": MODEL_NAME, "vocab_size": str(VOCAB_SIZE), "d_model": str(D_MODEL),
            "execution_provider": "CPUExecutionProvider"}  # fmt: skip
    assert want.items() <= info.labels.items(), info.labels


def test_prometheus_scrapes_the_server(stack: Stack) -> None:
    """The compose Prometheus, with the repo's prometheus.yml, finds the server up and
    sees the requests the earlier tests sent."""
    from tokembed.client import EmbeddingClient

    assert (PROMETHEUS_DIR / "prometheus.yml").exists()

    def target_up() -> bool:
        result = _prometheus_query(stack.prometheus_port, 'up{job="tokembed"}')
        return len(result) == 1 and result[0]["value"][1] == "1"

    _wait_for('Prometheus to report up{job="tokembed"} == 1', target_up, 60)
    client = EmbeddingClient(f"127.0.0.1:{stack.grpc_port}")
    try:
        for _ in range(5):
            client.embed([[1, 2]])
    finally:
        client.close()
    served = total(scrape(stack.metrics_port), "tokembed_requests_total", {"method": "Embed"})
    assert served >= 5

    def scraped_all() -> bool:
        query = 'sum(tokembed_requests_total{job="tokembed", method="Embed"})'
        result = _prometheus_query(stack.prometheus_port, query)
        return bool(result) and float(result[0]["value"][1]) == served

    _wait_for(f"Prometheus to see all {served:.0f} Embed calls", scraped_all, 60)


def test_stop_drains_and_exits_zero(stack: Stack) -> None:
    """Last: SIGTERM (compose stop) ends the server within its grace, with status 0."""
    (cid,) = stack.container_ids("tokembed")
    started = time.monotonic()
    stop = stack.compose_run("stop", "--timeout", "20", "tokembed")
    took = time.monotonic() - started
    assert stop.returncode == 0, stop.stderr
    state = stack.inspect(cid)["State"]
    assert state["Status"] == "exited" and state["ExitCode"] == 0, (state, stack.logs("tokembed"))
    assert took < 20, f"stop took {took:.1f}s: the server did not exit on SIGTERM"
