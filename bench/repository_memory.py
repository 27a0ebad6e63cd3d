"""Resident memory of a server whose model is swapped, and of its workers (issue 36's memory
figures).

    python -m tokembed.bench.repository_memory [--swaps 20] [--workers 4] [--dir DIR]
        [--vocab-size V] [--d-model D] [--table-cache on|off]

Builds a repository of one model with two versions of different tables (the built-in
model's shape unless ``--vocab-size``/``--d-model`` say otherwise, seeds 0 and 1: no
torch), serves it with ``tokembed serve --model-repository`` with every table kept (the
table budgets raised to the model's tables), and measures:

- (``--swaps N``, explicit mode, one process; 0 skips it) the server's resident memory:
  steady, version 1 loaded and answering; the peak during one swap to version 2 (the
  kernel's high-water mark, reset just before through /proc/PID/clear_refs), against
  steady + the new version's tables; after the first swap and after N swaps between the
  two versions (each measured once the old version is let go);
- (``--workers N``, poll mode: the workers load the repository each) the N worker
  processes' memory against one worker's alone (``--workers 1``): PSS summed (what they
  use between them: a page mapped by k processes counts 1/k in each), and, for honesty,
  RSS summed (which counts a shared page once per process) and USS summed (each
  process's private pages only).

``--table-cache on`` (the default): the server's table cache in a fresh directory under
the repository's (the first process computes each table and writes it, the others map it);
``off``: ``--table-cache-max-bytes 0``, each process computes and holds its own tables.

Prints one line per figure with its ratio; exits 0 whatever the figures (a measurement,
not a test).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

MODEL = "mem"


def build_repository(root: Path, vocab_size: int, d_model: int) -> int:
    """Two versions of ``MODEL``; returns the bytes of one version's tables."""
    from tokembed.export.builtin import BuiltinSpec, build_builtin_model

    for version, seed in ((1, 0), (2, 1)):
        target = root / MODEL / str(version)
        if not (target / "manifest.json").is_file():
            spec = BuiltinSpec(vocab_size, d_model, seed=seed, name=MODEL, version=str(version))
            build_builtin_model(target, spec)
    # float32, float16 and bfloat16 rows (the table backend's tables, every budget raised)
    return vocab_size * d_model * (4 + 2 + 2)


def server_flags(table_bytes: int, cache: Path | None) -> list[str]:
    """Every table kept, whatever the model's size; the table cache in ``cache`` (a fresh
    directory), or none."""
    kept = str(table_bytes)
    flags = ["--float32-table-max-bytes", kept, "--float16-table-max-bytes", kept,
             "--bfloat16-table-max-bytes", kept]  # fmt: skip
    if cache is None:
        return [*flags, "--table-cache-max-bytes", "0"]
    return [
        *flags,
        "--table-cache-dir",
        str(cache),
        "--table-cache-max-bytes",
        str(8 * table_bytes),
    ]


def start(args: list[str], processes: int = 1) -> tuple[subprocess.Popen[str], int]:
    """``tokembed serve`` with ``args``, once each of its ``processes`` says it serves."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tokembed.cli", "serve", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    port, serving = 0, 0
    for line in process.stdout:
        if match := re.search(r"listening on \S+:(\d+) \(gRPC", line):
            port = int(match.group(1))
        if "serving model" in line:
            serving += 1
            if serving == processes:
                break
    else:
        raise RuntimeError("the server did not start")
    # What the server writes from now on is read (and dropped), so that it never blocks.
    threading.Thread(target=process.stdout.read, daemon=True).start()
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


def swaps(root: Path, count: int, table_bytes: int, flags: list[str]) -> None:
    from tokembed.client import EmbeddingClient

    process, port = start([
        "--model-repository", str(root), "--model-control-mode", "explicit", "--port", "0",
        "--metrics-port", "-1", "--memory-trim-interval-s", "0.2", *flags,
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


def memory(pid: int) -> dict[str, int]:
    """A process's resident (RSS), proportional (PSS) and unique (USS) bytes."""
    info = psutil.Process(pid).memory_full_info()
    return {"rss": int(info.rss), "pss": int(info.pss), "uss": int(info.uss)}


def workers(root: Path, count: int, flags: list[str]) -> None:
    import socket

    from tokembed.client import EmbeddingClient

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results: dict[int, dict[str, int]] = {}
    for n in (1, count):
        process, _ = start([
            "--model-repository", str(root), "--model-control-mode", "poll", "--port", str(port),
            "--metrics-port", "-1", "--workers", str(n), *flags,
        ], processes=n)  # fmt: skip
        try:
            with EmbeddingClient(f"127.0.0.1:{port}", timeout_s=60) as client:
                for _ in range(50):
                    client.embed([[1, 2, 3]])
            time.sleep(2.0)  # memory trimmed after the loads
            if n == 1:
                pids = [process.pid]
            else:  # the workers: the supervisor's spawned children
                children = psutil.Process(process.pid).children()
                pids = [c.pid for c in children if "spawn_main" in " ".join(c.cmdline())]
            each = [memory(pid) for pid in pids]
            results[n] = {what: sum(m[what] for m in each) for what in ("rss", "pss", "uss")}
        finally:
            process.terminate()
            process.wait(60)
    mib = 1 << 20
    for what in ("pss", "rss", "uss"):
        one, all_ = results[1][what], results[count][what]
        print(f"{what.upper()}: --workers 1: {one / mib:.1f} MiB; --workers {count}: "
              f"{all_ / mib:.1f} MiB in all; ratio {all_ / one:.2f}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--swaps", type=int, default=20, help="0: no swap measurement")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None, help="where the repository is built")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--table-cache", choices=("on", "off"), default="on")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="tokembed-repo-memory-"))
    table_bytes = build_repository(root, args.vocab_size, args.d_model)
    print(f"V={args.vocab_size} D={args.d_model}; one version's tables "
          f"{table_bytes / (1 << 20):.1f} MiB; table cache {args.table_cache}")  # fmt: skip

    def flags() -> list[str]:  # a fresh cache for each measurement: its first load computes
        if args.table_cache == "off":
            return server_flags(table_bytes, None)
        return server_flags(table_bytes, Path(tempfile.mkdtemp(prefix="tables-", dir=root)))

    try:
        if args.swaps > 0:
            swaps(root, args.swaps, table_bytes, flags())
        if args.workers > 1:
            workers(root, args.workers, flags())
    finally:
        for cache in root.glob("tables-*"):
            shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps({"repository": str(root)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
