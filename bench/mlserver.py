"""MLServer for the bench's V2 section: installed from PyPI into a virtual environment of
its own (its dependencies are not tokembed's), serving the bench model's ``model.onnx``
through onnxruntime with adaptive batching, over the Open Inference Protocol's gRPC.

MLServer ships no onnxruntime runtime, so the harness writes one (``RUNTIME_SOURCE``: load
the session with one intra-op thread, as tokembed serve runs onnxruntime; decode the ids,
run, encode the answer with MLServer's numpy codec). Adaptive batching is on:
``max_batch_size`` 32, ``max_batch_time`` 2 ms (tokembed serve's ``--max-delay-ms``).
MLServer answers in ``raw_output_contents`` when the request came in ``raw_input_contents``,
as tritonclient sends it.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

from tokembed.bench.processes import Child

MLSERVER_REQUIREMENTS = ("mlserver==1.7.1", "onnxruntime", "numpy")
MAX_BATCH_SIZE = 32
MAX_BATCH_TIME_S = 0.002
_GRPC_PORT = re.compile(r"gRPC server running on \S+?:(\d+)")

RUNTIME_SOURCE = '''\
"""tokembed bench: an onnxruntime runtime for MLServer (written by tokembed.bench.mlserver)."""

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxEmbedding(MLModel):
    async def load(self) -> bool:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self._session = ort.InferenceSession(
            self.settings.parameters.uri, options, providers=["CPUExecutionProvider"]
        )
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        ids = NumpyCodec.decode_input(payload.inputs[0]).astype(np.int64, copy=False)
        (hidden,) = self._session.run(None, {"input_ids": ids})
        return InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            outputs=[NumpyCodec.encode_output("hidden_states", hidden)],
        )
'''


class MLServerUnavailable(Exception):
    """MLServer could not be installed or started; the message says why."""


def ensure_venv(directory: Path, progress: object = print) -> Path:
    """A virtual environment with MLServer, made once in ``directory``; its python."""
    python = directory / "bin" / "python"
    marker = directory / ".tokembed-installed"
    wanted = "\n".join(MLSERVER_REQUIREMENTS)
    if marker.is_file() and marker.read_text() == wanted:
        return python
    say = progress if callable(progress) else print
    say(f"installing {', '.join(MLSERVER_REQUIREMENTS)} into {directory} (once)")
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(directory)],
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         *MLSERVER_REQUIREMENTS],
    ]  # fmt: skip
    for step in steps:
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=1200)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MLServerUnavailable(f"{' '.join(step[:4])}: {exc}") from exc
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise MLServerUnavailable(f"{' '.join(step[:4])} failed: {' | '.join(tail)}")
    marker.write_text(wanted)
    return python


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def model_repository(directory: Path, model_name: str, model_onnx: Path) -> Path:
    """MLServer's settings and one model's folder (settings, the runtime) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    settings = {
        "host": "127.0.0.1",
        "http_port": _free_port(),
        "grpc_port": _free_port(),
        "metrics_port": _free_port(),
        # The model runs in the server's own process: no worker pool to hand requests to.
        "parallel_workers": 0,
        "debug": False,
    }
    (directory / "settings.json").write_text(json.dumps(settings, indent=1))
    model_dir = directory / model_name
    model_dir.mkdir(exist_ok=True)
    (model_dir / "tokembed_runtime.py").write_text(RUNTIME_SOURCE)
    (model_dir / "model-settings.json").write_text(json.dumps({
        "name": model_name,
        "implementation": "tokembed_runtime.OnnxEmbedding",
        "parameters": {"uri": str(model_onnx.resolve())},
        "max_batch_size": MAX_BATCH_SIZE,
        "max_batch_time": MAX_BATCH_TIME_S,
    }, indent=1))  # fmt: skip
    return directory


def mlserver(python: Path, repository: Path) -> Child:
    """``mlserver start REPOSITORY`` as a child; ready once its gRPC server runs (MLServer
    loads its models before it starts serving)."""
    return Child(
        [str(python.parent / "mlserver"), "start", str(repository)],
        _GRPC_PORT,
        "gRPC server running on",
        env={"PYTHONPATH": ""},  # nothing of tokembed's environment leaks into MLServer's
    )
