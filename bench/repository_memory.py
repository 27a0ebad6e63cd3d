"""Resident memory of a server whose model is swapped (issue 36's memory figures).

    python -m tokembed.bench.repository_memory [--swaps 20] [--workers 4] [--dir DIR]

Builds a repository of one model with two versions of different tables (the built-in
model's shape, V=32000 D=512, seeds 0 and 1: no torch), serves it with ``tokembed serve
--model-repository`` in explicit mode, and measures the server process's resident memory:

- steady: version 1 loaded and answering;
- the peak during one swap to version 2 (the kernel's high-water mark, reset just
  before through /proc/PID/clear_refs), against steady + the new version's tables;
- after the first swap and after ``--swaps`` swaps between the two versions (each
  measured once the old version is let go);
- with ``--workers N`` (poll mode: the workers load the repository each), the sum of the
  N worker processes' resident memory against one worker's.

Prints one line per figure with its ratio; exits 0 whatever the figures (a measurement,
not a test).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

MODEL = "mem"


def build_repository(root: Path) -> int:
    """Two versions of ``MODEL``; returns the bytes of one version's tables."""
    from tokembed.export.builtin import BuiltinSpec, build_builtin_model

    for version, seed in ((1, 0), (2, 1)):
        target = root / MODEL / str(version)
        if not (target / "manifest.json").is_file():
            build_builtin_model(target, BuiltinSpec(seed=seed, name=MODEL, version=str(version)))
    spec = BuiltinSpec()
    # float32, float16 and bfloat16 rows (the table backend's defaults)
    return spec.vocab_size * spec.d_model * (4 + 2 + 2)


def start(args: list[str]) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tokembed.cli", "serve", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    port = 0
    for line in process.stdout:
        if match := re.search(r"listening on \S+:(\d+) \(gRPC", line):
            port = int(match.group(1))
        if "serving model" in line:
            break
    else:
        raise RuntimeError("the server did not start")
    return process, port


def rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def peak_since_reset(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def only(version: int) -> dict[str, object]:
    return {"version_policy": {"specific": {"versions": [version]}}}


def swap_to(client: object, version: int) -> None:
    from tokembed.client import EmbeddingClient

    assert isinstance(client, EmbeddingClient)
    client.load_model(MODEL, config=only(version))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the old version let go
        states = [m.state for m in client.repository_index()]
        if states.count("READY") == 1 and "UNLOADING" not in states:
            break
        time.sleep(0.02)
    client.embed([[1, 2, 3]])


def swaps(root: Path, count: int, table_bytes: int) -> None:
    from tokembed.client import EmbeddingClient

    process, port = start([
        "--model-repository", str(root), "--model-control-mode", "explicit", "--port", "0",
        "--metrics-port", "-1", "--memory-trim-interval-s", "0.2",
    ])  # fmt: skip
    try:
        with EmbeddingClient(f"127.0.0.1:{port}", timeout_s=120) as client:
            client.load_model(MODEL, config=only(1))
            for _ in range(100):
                client.embed([[1, 2, 3]])
            time.sleep(1.0)
            steady = rss(process.pid)
            reset_peak(process.pid)
            swap_to(client, 2)
            peak = peak_since_reset(process.pid)
            time.sleep(1.0)
            after_first = rss(process.pid)
            for i in range(count - 1):
                swap_to(client, 1 if i % 2 == 0 else 2)
            time.sleep(1.0)
            after_all = rss(process.pid)
    finally:
        process.terminate()
        process.wait(30)
    mib = 1 << 20
    bound = (steady + table_bytes) * 1.1
    print(f"steady RSS {steady / mib:.1f} MiB; one version's tables {table_bytes / mib:.1f} MiB")
    print(f"peak RSS during a swap {peak / mib:.1f} MiB; (steady + tables) x 1.1 = "
          f"{bound / mib:.1f} MiB; ratio peak / (steady + tables) "
          f"{peak / (steady + table_bytes):.3f}")  # fmt: skip
    print(f"RSS after the first swap {after_first / mib:.1f} MiB, after {count} swaps "
          f"{after_all / mib:.1f} MiB; ratio {after_all / after_first:.3f}")  # fmt: skip


def workers(root: Path, count: int) -> None:
    import socket

    from tokembed.client import EmbeddingClient

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = {}
    for n in (1, count):
        process, _ = start([
            "--model-repository", str(root), "--model-control-mode", "poll", "--port", str(port),
            "--metrics-port", "-1", "--workers", str(n),
        ])  # fmt: skip
        try:
            time.sleep(5.0)  # every worker loaded (each logs; the first line started us)
            with EmbeddingClient(f"127.0.0.1:{port}", timeout_s=60) as client:
                for _ in range(50):
                    client.embed([[1, 2, 3]])
            if n == 1:
                results[n] = rss(process.pid)
            else:  # the workers: the supervisor's spawned children
                children = psutil.Process(process.pid).children()
                spawned = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
                results[n] = sum(rss(c.pid) for c in spawned)
        finally:
            process.terminate()
            process.wait(60)
    mib = 1 << 20
    print(f"--workers 1: {results[1] / mib:.1f} MiB; --workers {count}: {results[count] / mib:.1f}"
          f" MiB in all; ratio {results[count] / results[1]:.2f}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--swaps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None, help="where the repository is built")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="tokembed-repo-memory-"))
    table_bytes = build_repository(root)
    swaps(root, args.swaps, table_bytes)
    if args.workers > 1:
        workers(root, args.workers)
    print(json.dumps({"repository": str(root)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
