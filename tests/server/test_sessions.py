"""onnxruntime sessions on a small exported model: E[id] * scale, the float16 cast, the
providers and the CPU arena (server/backends/sessions.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from tokembed.export.model_dir import load_model_dir
from tokembed.server.backends import sessions as sessions_module
from tokembed.server.backends.sessions import (
    CPU,
    CUDA,
    Graph,
    ModelSession,
    OutputCast,
    SessionOptions,
)
from tokembed.server.core.dtypes import FLOAT16
from tokembed.server.core.errors import ServerConfigError
from tokembed.server.models.loading import graph_of

from support.fixtures import SMALL_D, SMALL_PAD, SMALL_V

HAS_CUDA = CUDA in ort.get_available_providers()


def _graph(model_dir: Path) -> Graph:
    return graph_of(load_model_dir(model_dir))


@pytest.fixture(scope="module")
def cpu_runtime(small_model_dir: Path) -> ModelSession:
    return ModelSession(_graph(small_model_dir), SessionOptions(device="cpu"))


@pytest.fixture
def without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make a CUDA machine look like one without (a no-op where there is none)."""
    if HAS_CUDA:
        monkeypatch.setattr(sessions_module, "available_providers", lambda: [CPU])


def test_rows_are_exactly_the_scaled_table_rows(
    cpu_runtime: ModelSession, small_rows: np.ndarray
) -> None:
    rng = np.random.default_rng(0)
    ids = np.concatenate([[0, 1, SMALL_V - 1, SMALL_PAD, 5, 5], rng.integers(0, SMALL_V, 500)])
    rows = cpu_runtime.run(ids.astype(np.int64))
    assert rows.shape == (ids.size, SMALL_D) and rows.dtype == np.float32
    np.testing.assert_array_equal(rows, small_rows[ids])
    assert not rows[3].any()  # the padding id's row is zero
    assert cpu_runtime.provider == CPU
    assert cpu_runtime.d_model == SMALL_D


def test_a_single_id_and_the_whole_vocabulary(
    cpu_runtime: ModelSession, small_rows: np.ndarray
) -> None:
    np.testing.assert_array_equal(cpu_runtime.run(np.array([7], dtype=np.int64)), small_rows[[7]])
    everything = np.arange(SMALL_V, dtype=np.int64)
    np.testing.assert_array_equal(cpu_runtime.run(everything), small_rows)


def test_each_run_returns_a_fresh_array_the_caller_owns(cpu_runtime: ModelSession) -> None:
    ids = np.array([1, 2, 3], dtype=np.int64)
    first = cpu_runtime.run(ids)
    second = cpu_runtime.run(ids)
    first[:] = 0  # writable, and shared with nobody
    assert second.any()
    np.testing.assert_array_equal(cpu_runtime.run(ids), second)


def test_float16_cast_rounds_exactly_as_numpy_does() -> None:
    rng = np.random.default_rng(2)
    rows = (rng.standard_normal((300, SMALL_D)) * 8).astype(np.float32)
    # Edges: ties, the largest half, overflow to inf, subnormals, signed zeros.
    rows[0, :10] = [
        65504.0,
        65520.0,
        1e6,
        -1e6,
        6e-8,
        3e-8,
        -0.0,
        0.0,
        1.0 + 2**-11,
        1.0 + 3 * 2**-11,
    ]
    got = OutputCast(FLOAT16, SessionOptions())(rows)
    with np.errstate(over="ignore"):  # 1e6 overflowing to inf is the point here
        want = rows.astype(np.float16)
    assert got.dtype == np.float16 and got.shape == rows.shape
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_thread_counts_reach_the_session_and_every_row_is_the_model_s(
    small_model_dir: Path, small_rows: np.ndarray
) -> None:
    runtime = ModelSession(
        _graph(small_model_dir),
        SessionOptions(device="cpu", intra_op_threads=3, inter_op_threads=2),
    )
    # onnxruntime's own account of the options the session was made with.
    options = runtime.session.get_session_options()
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (3, 2)
    np.testing.assert_array_equal(runtime.run(np.array([9], dtype=np.int64)), small_rows[[9]])
    # In chunks smaller than the vocabulary (7 rows each), as the table backend loads it.
    np.testing.assert_array_equal(runtime.every_row(chunk_bytes=7 * SMALL_D * 4), small_rows)


# Run in a fresh interpreter: nothing else starts threads there, so the threads a load
# adds are its onnxruntime sessions' (an intra-op pool of n threads is the caller and
# n - 1 threads of its own, made with the session).
_THREADS_SCRIPT = """
import os
import sys
from pathlib import Path
from tokembed.server.models.loading import load_model
from tokembed.server.process.settings import Settings

def threads():
    return len(os.listdir("/proc/self/task"))

directory, *counts = sys.argv[1:]
loaded = []  # kept, so that their sessions (and threads) live on
for count in counts:
    settings = Settings.from_cli(
        ["--model-dir", directory, "--intra-op-threads", count, "--float32-table-max-bytes", "0"]
    )
    before = threads()
    loaded.append(load_model(Path(directory), settings))
    assert loaded[-1].backend.kind == "onnxruntime", loaded[-1].backend.kind
    print(threads() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
def test_intra_op_threads_flag_sizes_the_loaded_backend_s_thread_pools(
    small_model_dir: Path,
) -> None:
    """--intra-op-threads, parsed as ``tokembed serve`` parses it and loaded as the server
    loads a model, decides how many threads onnxruntime computes with: each session of
    the onnxruntime backend gets n - 1 threads of its own (none at 1).

    --inter-op-threads reaches the session's options (the test above) but no test can see
    it change what runs: onnxruntime only uses an inter-op pool in its parallel execution
    mode, and the sessions run sequentially."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TOKEMBED_")}
    result = subprocess.run(
        [sys.executable, "-c", _THREADS_SCRIPT, str(small_model_dir), "1", "2", "4", "1"],
        capture_output=True, text=True, timeout=120, check=False, env=environ,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    one, two, four, one_again = (int(line) for line in result.stdout.split())
    assert one == 0 and one_again == 0, result.stdout
    assert two >= 1, result.stdout  # at least the look-up's session: one thread each
    assert four == 3 * two, result.stdout  # every session: three threads each


def test_cuda_without_cuda_is_a_clear_config_error(
    small_model_dir: Path, without_cuda: None
) -> None:
    with pytest.raises(ServerConfigError) as error:
        ModelSession(_graph(small_model_dir), SessionOptions(device="cuda"))
    message = str(error.value)
    assert "CUDA execution provider not available" in message
    assert CPU in message  # says what onnxruntime does offer
    assert "tokembed[gpu]" in message  # and how to get CUDA


def test_auto_without_cuda_falls_back_to_cpu_with_a_warning(
    small_model_dir: Path,
    without_cuda: None,
    small_rows: np.ndarray,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="tokembed.server.backends.sessions"):
        runtime = ModelSession(_graph(small_model_dir), SessionOptions(device="auto"))
    assert runtime.provider == CPU
    assert runtime.session.get_providers()[0] == CPU
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("falling back to CPU" in r.getMessage() for r in warnings), caplog.text
    np.testing.assert_array_equal(runtime.run(np.array([4, 2], dtype=np.int64)), small_rows[[4, 2]])


def test_cpu_device_logs_no_warning(
    small_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tokembed.server.backends.sessions"):
        ModelSession(_graph(small_model_dir), SessionOptions(device="cpu"))
    assert not caplog.records


def test_unknown_device_is_refused(small_model_dir: Path) -> None:
    with pytest.raises(ServerConfigError, match="device must be cpu, cuda or auto, got 'tpu'"):
        ModelSession(_graph(small_model_dir), SessionOptions(device="tpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_cuda_provider_runs_the_look_up(
    small_model_dir: Path, small_rows: np.ndarray, device: str
) -> None:
    if not HAS_CUDA:
        pytest.skip(
            f"needs onnxruntime-gpu and a GPU: onnxruntime {ort.__version__} offers "
            f"{ort.get_available_providers()}"
        )
    runtime = ModelSession(_graph(small_model_dir), SessionOptions(device=device))
    assert runtime.provider == CUDA
    rng = np.random.default_rng(1)
    ids = rng.integers(0, SMALL_V, 4096).astype(np.int64)
    # One Gather and one float32 multiply: exact on the GPU too.
    np.testing.assert_array_equal(runtime.run(ids), small_rows[ids])


# Run in a fresh interpreter: the CPU arena is process-wide (the first runtime fixes its
# size), and the resident memory measured must be this script's alone.
_ARENA_BURST_SCRIPT = """
import sys
import numpy as np
from tokembed.export.model_dir import load_model_dir
from tokembed.server.process.memory import release_free_memory
from tokembed.server.backends.sessions import ModelSession, SessionOptions
from tokembed.server.models.loading import graph_of

def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096

d_model, batch_tokens = int(sys.argv[2]), int(sys.argv[3])
runtime = ModelSession(
    graph_of(load_model_dir(sys.argv[1])),
    SessionOptions(device="cpu", batch_output_bytes=batch_tokens * d_model * 4),
)
runtime.run(np.arange(batch_tokens, dtype=np.int64) % 1000)  # the warm-up's full batch
ids = np.arange(batch_tokens, dtype=np.int64) % 1000
idle = rss()
burst = [runtime.run(ids) for _ in range(16)]  # 16 answers in flight: far past the first region
assert all(np.array_equal(rows, burst[0]) for rows in burst)
peak = rss()
del burst
runtime.run(ids[:8])  # any later run gives the emptied regions back to malloc,
release_free_memory()  # which hands them to the OS (the server does this every second)
after = rss()
print(idle, peak, after)
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc (Linux)")
def test_arena_gives_back_what_a_burst_added(small_model_dir: Path) -> None:
    batch_tokens = 16384  # 4 MiB of rows at D=64: 16 held answers are 64 MiB
    result = subprocess.run(
        [sys.executable, "-c", _ARENA_BURST_SCRIPT, str(small_model_dir), str(SMALL_D),
         str(batch_tokens)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    idle, peak, after = (int(value) for value in result.stdout.split())
    added = batch_tokens * SMALL_D * 4 * 16
    assert peak - idle > 0.8 * added, (idle, peak, after)  # the burst really was resident
    # onnxruntime's default arena would keep all of it; this one keeps its first region
    # (two batches' rows, touched at warm-up, so already in ``idle``).
    assert after - idle < 0.15 * added, (idle, peak, after)
