"""``--workers N``: several server processes share one port through SO_REUSEPORT."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from tokembed.client import EmbeddingClient

from support.metrics import scrape, total, workers_ready
from support.ports import free_ports
from support.server import wait_for


def _served_by(metrics_port: int) -> float:
    ok = {"method": "Embed", "code": "OK", "model": "small"}
    return total(scrape(metrics_port, timeout_s=5), "tokembed_requests_total", ok)


def test_two_workers_share_the_port_and_both_serve(
    small_model_dir: Path, small_rows: np.ndarray
) -> None:
    # One run: the gRPC port, then the workers' metrics ports (--metrics-port and up).
    port, metrics_base, _ = free_ports(3, consecutive=True)
    process = subprocess.Popen(
        [sys.executable, "-m", "tokembed.cli", "serve", "--model-dir", str(small_model_dir),
         "--port", str(port), "--metrics-port", str(metrics_base), "--workers", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert wait_for(lambda: workers_ready(metrics_base, 2), 60, 0.2)
        # Each client opens its own connection; the kernel spreads connections.
        for index in range(40):
            options = (("grpc.use_local_subchannel_pool", 1),)
            with EmbeddingClient(f"127.0.0.1:{port}", channel_options=options) as client:
                np.testing.assert_array_equal(client.embed([[index]]), small_rows[[[index]]])
        served = [_served_by(metrics_base + i) for i in range(2)]
        assert sum(served) == 40
        assert min(served) > 0, f"one worker took every connection: {served}"
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr


def test_two_workers_serve_from_one_mapped_table_file(
    small_model_dir: Path, small_rows: np.ndarray, tmp_path: Path
) -> None:
    """The table cache: the workers' tables are one set of files, each mapped by both
    processes, and the answers are the model's rows bit for bit."""
    import psutil

    cache = tmp_path / "tables"
    port, metrics_base, _ = free_ports(3, consecutive=True)
    process = subprocess.Popen(
        [sys.executable, "-m", "tokembed.cli", "serve", "--model-dir", str(small_model_dir),
         "--port", str(port), "--metrics-port", str(metrics_base), "--workers", "2",
         "--table-cache-dir", str(cache)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert wait_for(lambda: workers_ready(metrics_base, 2), 60, 0.2)
        files = {str(path) for path in cache.glob("*.rows")}
        assert len(files) == 3  # float32, float16 and bfloat16, written once
        children = psutil.Process(process.pid).children()
        workers = [child for child in children if "spawn_main" in " ".join(child.cmdline())]
        assert len(workers) == 2
        for worker in workers:
            maps = Path(f"/proc/{worker.pid}/maps").read_text()
            assert all(path in maps for path in files), (worker.pid, files)
        ids = np.arange(small_rows.shape[0]).reshape(4, -1)
        for _ in range(40):  # the kernel spreads connections over both workers
            options = (("grpc.use_local_subchannel_pool", 1),)
            with EmbeddingClient(f"127.0.0.1:{port}", channel_options=options) as client:
                np.testing.assert_array_equal(client.embed(ids), small_rows[ids])
                half = client.embed(ids, "float16")
                np.testing.assert_array_equal(half, small_rows[ids].astype(np.float16))
        assert min(_served_by(metrics_base + i) for i in range(2)) > 0
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
