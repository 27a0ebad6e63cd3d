"""The onnxruntime session: one look-up of a flat id array, nothing about batching.

``run`` is synchronous and thread-safe (onnxruntime allows concurrent ``run`` calls on
one session and releases the GIL while it computes); callers put it on an executor.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from tokembed.export.model_dir import ModelDir
from tokembed.server.errors import ServerConfigError

logger = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


@dataclass(frozen=True)
class RuntimeOptions:
    device: str = "cpu"
    intra_op_threads: int = 1
    inter_op_threads: int = 0


class EmbeddingRuntime:
    """Runs ``hidden_states = model(input_ids)`` for ids already validated to be in [0, V)."""

    def __init__(self, model: ModelDir, options: RuntimeOptions) -> None:
        self.model = model
        manifest = model.manifest
        self.input_name = manifest.input.name
        self.output_name = manifest.output.name
        self.d_model = manifest.d_model
        self.session = _create_session(model, options)
        self.provider = self.session.get_providers()[0]
        self._caster = _float16_caster(options)

    def to_float16(self, rows: np.ndarray) -> np.ndarray:
        """float32 -> float16, round to nearest even, as numpy's ``astype`` does; onnxruntime's
        Cast is vectorised (8.5 ms for 33.5 MB here, against 25-44 ms for ``astype``)."""
        output = self._caster.run(None, {"x": rows})[0]
        return output  # type: ignore[no-any-return]

    def float16_table(self, chunk_bytes: int = 8 * 1024 * 1024) -> np.ndarray:
        """Every row, looked up with the model and rounded to float16: ``[V, D]``.

        Computed with the same two steps a float16 request takes (the look-up, then the
        cast), so serving float16 from it is bit-identical, at half the bytes to gather.
        """
        vocab = self.model.manifest.vocab_size
        table = np.empty((vocab, self.d_model), dtype=np.float16)
        step = max(1, chunk_bytes // (self.d_model * 4))
        for start in range(0, vocab, step):
            stop = min(vocab, start + step)
            ids = np.arange(start, stop, dtype=np.int64)
            table[start:stop] = self.to_float16(self.run(ids))
        return table

    def run(self, ids: np.ndarray) -> np.ndarray:
        """``ids``: int64 [N]. Returns float32 [N, D], a fresh array the caller owns."""
        output = self.session.run([self.output_name], {self.input_name: ids.reshape(1, -1)})[0]
        return output.reshape(-1, self.d_model)  # type: ignore[no-any-return]

    def warm_up(self) -> float:
        """One small and one larger run, so the first request pays no allocation cost."""
        started = time.perf_counter()
        vocab = self.model.manifest.vocab_size
        for size in (8, 4096):
            ids = np.arange(size, dtype=np.int64) % vocab
            self.run(ids)
        return time.perf_counter() - started


def available_providers() -> list[str]:
    return list(ort.get_available_providers())


def _session_options(options: RuntimeOptions) -> ort.SessionOptions:
    session_options = ort.SessionOptions()
    session_options.intra_op_num_threads = options.intra_op_threads
    session_options.inter_op_num_threads = options.inter_op_threads
    # onnxruntime's CPU arena is kept (the default): it holds on to the largest batch
    # output it has handed out (at most max_batch_tokens x D x 4 bytes per batch computing)
    # and reuses it; without it every look-up's output is fresh zero-filled pages, and a
    # [32,512] look-up at D=512 takes 40 ms instead of 14 ms here.
    # Idle onnxruntime threads spin by default, burning the cores gRPC needs.
    session_options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session_options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return session_options


def _float16_caster(options: RuntimeOptions) -> ort.InferenceSession:
    """A one-node graph, Cast(float32 -> float16), for float16 answers (always on CPU:
    the rows are on the CPU by the time they are cast)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT16)],
        "tokembed_float16_cast",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return ort.InferenceSession(
        model.SerializeToString(), _session_options(options), providers=[CPU]
    )


def _create_session(model: ModelDir, options: RuntimeOptions) -> ort.InferenceSession:
    session_options = _session_options(options)
    # The graph is one Gather and one Mul; nothing to fuse, and a fixed graph keeps the
    # float32 results bit-identical to the export-time parity check.
    session_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    path = str(model.model_path)
    if options.device == "cpu":
        return ort.InferenceSession(path, session_options, providers=[CPU])
    if options.device not in ("cuda", "auto"):
        raise ServerConfigError(f"device must be cpu, cuda or auto, got {options.device!r}")
    if CUDA not in available_providers():
        message = (
            f"CUDA execution provider not available (onnxruntime {ort.__version__} offers "
            f"{available_providers()}; install tokembed[gpu] on a machine with a GPU)"
        )
        if options.device == "cuda":
            raise ServerConfigError(message)
        logger.warning("%s; falling back to CPU", message)
        return ort.InferenceSession(path, session_options, providers=[CPU])
    try:
        session = ort.InferenceSession(path, session_options, providers=[CUDA, CPU])
    except Exception as exc:
        if options.device == "cuda":
            raise ServerConfigError(f"cannot start the CUDA execution provider: {exc}") from exc
        logger.warning("CUDA execution provider failed (%s); falling back to CPU", exc)
        return ort.InferenceSession(path, session_options, providers=[CPU])
    # onnxruntime silently drops a provider that fails to initialise (missing CUDA
    # libraries): report what it actually uses, never what was asked for.
    if session.get_providers()[0] != CUDA:
        if options.device == "cuda":
            raise ServerConfigError(
                f"asked for CUDA but onnxruntime uses {session.get_providers()}; "
                "check the CUDA and cuDNN libraries"
            )
        logger.warning("CUDA execution provider did not initialise; falling back to CPU")
    return session
