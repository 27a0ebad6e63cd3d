"""Readers for the deployment files, shared by the static checks and the container test.

Plain functions over the repository's files, no fixtures: what the server really listens
on comes from ``tokembed.server.process.settings`` (its defaults and its TOKEMBED_* parsing), and
which metrics it really exports from the registry of a ``TokembedServer`` as it is built.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "tokembed.json"
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.override.yml")
PODMAN_OVERRIDE = "deploy/compose/podman-local.override.yml"

# The metric names the server's contract promises (issue 4); the dashboard may use no other.
CONTRACT_METRICS = {
    "tokembed_requests_total": "counter",
    "tokembed_request_duration_seconds": "histogram",
    "tokembed_queue_wait_seconds": "histogram",
    "tokembed_compute_seconds": "histogram",
    "tokembed_encode_seconds": "histogram",
    "tokembed_batch_requests": "histogram",
    "tokembed_batch_tokens": "histogram",
    "tokembed_batches_total": "counter",
    "tokembed_tokens_total": "counter",
    "tokembed_output_bytes_total": "counter",
    "tokembed_rejections_total": "counter",
    "tokembed_inflight_requests": "gauge",
    "tokembed_queued_tokens": "gauge",
    "tokembed_model_info": "gauge",
}
# Not the server's own settings, yet read from TOKEMBED_*: `tokembed health`'s target.
CLIENT_ENV = {"TOKEMBED_TARGET"}


def series_names(families: Mapping[str, str]) -> set[str]:
    """Sample names Prometheus stores for metric families {name: type}."""
    out: set[str] = set()
    for name, kind in families.items():
        if kind == "histogram":
            out |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif kind == "counter":
            base = name.removesuffix("_total")
            out |= {f"{base}_total"}
        else:
            out.add(name)
    return out


def server_metric_families() -> dict[str, str]:
    """{family name: type} of every metric the server registers, process collectors too:
    those of ``tokembed.server.observability.metrics`` and those the server wires in as it is built
    (what is served, read from its repository at each scrape). Built, never started."""
    from tokembed.server.app import TokembedServer
    from tokembed.server.process.settings import Settings

    registry = TokembedServer(Settings()).registry
    return {family.name: family.type for family in registry.collect()}


# --- server settings --------------------------------------------------------------------


def settings_from_env(env: Mapping[str, str]) -> Any:
    """The Settings that `tokembed serve` builds from these variables (and no flags)."""
    from tokembed.server.process.settings import Settings

    parser = argparse.ArgumentParser()
    Settings.add_arguments(parser)
    return Settings.from_args(parser.parse_args([]), dict(env))


def settings_env_names() -> set[str]:
    from dataclasses import fields

    from tokembed.server.process.settings import ENV_PREFIX, Settings

    return {ENV_PREFIX + spec.name.upper() for spec in fields(Settings)}


# --- Dockerfiles ------------------------------------------------------------------------


@dataclass
class Instruction:
    keyword: str
    args: str


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [i.args for i in self.instructions if i.keyword == keyword]

    def copies_from(self) -> list[tuple[str, list[str]]]:
        """(stage, source paths) of every COPY --from=stage."""
        out = []
        for args in self.all("COPY"):
            words = args.split()
            source = [w.split("=", 1)[1] for w in words if w.startswith("--from=")]
            if source:
                paths = [w for w in words if not w.startswith("--")][:-1]
                out.append((source[0], paths))
        return out


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)

    def resolve(self, text: str, args: Mapping[str, str]) -> str:
        values = {**self.global_args, **args}
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values[m.group(1) or m.group(2)], text)

    def parent(self, stage: Stage, args: Mapping[str, str]) -> Stage | None:
        """The stage `stage` is built FROM, or None for an external image."""
        base = self.resolve(stage.base, args)
        names = {s.name for s in self.stages}
        return self.stage(base) if base in names else None

    def chain(self, stage: Stage, args: Mapping[str, str]) -> list[Stage]:
        """The stage and its FROM ancestors inside this file: everything its filesystem holds."""
        out = [stage]
        parent = self.parent(stage, args)
        while parent is not None:
            out.append(parent)
            parent = self.parent(parent, args)
        return out


def parse_dockerfile(path: Path) -> Dockerfile:
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and pending):
            continue  # comments, also inside a continued instruction, as Docker does
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        if pending or line:
            logical.append(pending + line)
        pending = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        args = args.strip()
        if keyword == "FROM":
            words = args.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name=name, base=words[0]))
        elif not stages:
            assert keyword == "ARG", f"{path}: {keyword} before the first FROM"
            key, _, value = args.partition("=")
            global_args[key] = value
        else:
            stages[-1].instructions.append(Instruction(keyword, args))
    return Dockerfile(global_args, stages)


def exec_form(args: str) -> list[str] | None:
    """The JSON array of an exec-form instruction, or None for the shell form."""
    import json

    text = args.strip()
    if not text.startswith("["):
        return None
    value = json.loads(text)
    assert isinstance(value, list)
    return [str(v) for v in value]


def env_of(stage: Stage) -> dict[str, str]:
    """The ENV a stage sets (key=value form)."""
    env: dict[str, str] = {}
    for args in stage.all("ENV"):
        for word in shlex.split(args):
            key, sep, value = word.partition("=")
            assert sep, f"ENV {args!r}: use the key=value form"
            env[key] = value
    return env


# --- the Grafana dashboard ----------------------------------------------------------------


@dataclass(frozen=True)
class PanelQuery:
    panel: str  # the panel's title
    ref_id: str
    expr: str  # PromQL, with Grafana's template variables in it
    legend: str  # legendFormat, "" when the panel has none

    @property
    def name(self) -> str:
        return f"{self.panel!r} {self.ref_id}"


def dashboard() -> dict[str, Any]:
    import json

    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_queries() -> list[PanelQuery]:
    """Every Prometheus query of every panel (rows' nested panels too)."""
    out = []
    panels = list(dashboard()["panels"])
    while panels:
        panel = panels.pop(0)
        panels.extend(panel.get("panels", []))  # a collapsed row holds its panels
        for target in panel.get("targets", []):
            legend = target.get("legendFormat") or ""
            out.append(PanelQuery(panel["title"], target["refId"], target["expr"], legend))
    assert out, f"{DASHBOARD} has no queries"
    return out


def grafana_regex_escape(value: str) -> str:
    """A selected value as Grafana writes it into a query for a multi-value variable:
    regex metacharacters escaped, doubled for the PromQL string it lands in
    (Grafana's prometheusSpecialRegexEscape)."""
    value = value.replace("\\", "\\\\\\\\")
    return re.sub(r"[$^*{}\[\]'+?.()|]", lambda m: "\\\\" + m.group(0), value)


def fill_variables(expr: str, values: Mapping[str, str]) -> str:
    """``expr`` with Grafana's variables ($name, ${name}) replaced by ``values``; a
    variable without a value is an error, so that a new one cannot pass unnoticed."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in values, f"no value for ${name} in {expr}"
        return values[name]

    filled = re.sub(r"\$\{(\w+)\}|\$(\w+)", replace, expr)
    assert "[[" not in filled, f"Grafana's deprecated [[variable]] syntax in {expr}"
    return filled


# --- tools ------------------------------------------------------------------------------


def run(cmd: list[str], *, timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
