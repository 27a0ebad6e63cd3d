"""The head graph (``head.onnx``) through onnxruntime: the way back's multiply and TopK on
the model's execution provider (the CUDA provider's, where the model runs there).

It runs the exported graph's ``Gemm`` (after its ``Cast`` of a narrow table) and ``TopK``,
with two changes made in memory, both for the exact answer ``backends.head`` guarantees:

- the graph's final norm, if it has one, is left out: the head applies the norm itself (in
  float32, as transformers does) and re-scores candidates against the very vectors the
  multiply was given, which the graph's own norm would round differently;
- the table is the array the head already holds (the look-up's own, or the mapped file),
  handed to onnxruntime as the graph's external initializer, never read a second time
  from disk here (onnxruntime copies it to the device on the CUDA provider).

And on the CUDA provider, TF32 is off (``use_tf32``): its 10-bit products would break the
float32 error bound that makes the re-scored answer exact.

Its answers are float32 logits ``[n, V]`` (``logits``), or the ``k`` largest of them and
their ids (``top``), which the head widens into the candidates it re-scores
(``NearestHead``). Thread-safe: onnxruntime allows concurrent ``run`` calls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from tokembed.server.backends.sessions import CPU, CUDA, SessionOptions, session_options
from tokembed.server.core.errors import ServerConfigError

# The names of head.onnx (export/head.py writes them; the manifest records its file).
VECTORS, K, SCORES, IDS, LOGITS = "vectors", "k", "scores", "ids", "logits"
TABLE = "head.weight"
_GEMM = "head"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadGraph:
    """A model's head graph, read there by server/models/loading.py (a backend never opens
    a model directory)."""

    path: Path


class HeadSession:
    """``h @ W.T`` and its top-k, by the head graph in an onnxruntime session."""

    def __init__(self, graph: HeadGraph, table: np.ndarray, options: SessionOptions) -> None:
        """``table``: ``W [V, D]`` as the head holds it (float32, float16, or bfloat16 as
        ``ml_dtypes`` holds it), which must outlive the session (on the CPU provider
        onnxruntime reads it in place)."""
        model = _without_norm(graph.path)
        self._table = table  # onnxruntime's initializer points into it
        self.vocab_size = int(table.shape[0])
        initializer = _ortvalue(table)
        so = session_options(options)
        so.add_external_initializers([TABLE], [initializer])
        self._initializer = initializer
        self.session = _create(model, so, options.device)
        self.provider: str = self.session.get_providers()[0]

    def logits(self, h: np.ndarray) -> np.ndarray:
        """float32 ``h [n, D] @ W.T``: ``[n, V]``."""
        feed = {VECTORS: h, K: np.array([1], dtype=np.int64)}
        return self.session.run([LOGITS], feed)[0]  # type: ignore[no-any-return]

    def top(self, h: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` largest float32 logits of each vector, largest first, and their ids
        (``[n, k]`` each; the logits themselves stay on the session's device)."""
        feed = {VECTORS: h, K: np.array([k], dtype=np.int64)}
        scores, ids = self.session.run([SCORES, IDS], feed)
        return scores, ids


def _without_norm(path: Path) -> bytes:
    """The head graph, its multiply reading ``vectors`` directly (the norm's nodes and
    parameters dropped), serialised; its table still the external initializer it names."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    gemm = next((node for node in graph.node if node.name == _GEMM), None)
    if gemm is None or gemm.op_type != "Gemm":
        raise ServerConfigError(f"{path}: no Gemm named {_GEMM!r}; export the head again")
    gemm.input[0] = VECTORS
    needed = _needed(graph, [output.name for output in graph.output])
    kept = [node for index, node in enumerate(graph.node) if index in needed]
    del graph.node[:]
    graph.node.extend(kept)
    used = {name for node in kept for name in node.input}
    initializers = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    return model.SerializeToString()


def _needed(graph: Any, outputs: list[str]) -> set[int]:
    """The nodes (by index) that the ``outputs`` depend on (``graph``: onnx's GraphProto)."""
    producers = {name: index for index, node in enumerate(graph.node) for name in node.output}
    needed: set[int] = set()
    pending = list(outputs)
    while pending:
        index = producers.get(pending.pop())
        if index is None or index in needed:
            continue
        needed.add(index)
        pending.extend(graph.node[index].input)
    return needed


def _ortvalue(table: np.ndarray) -> ort.OrtValue:
    """The table as an OrtValue over its own memory (no copy)."""
    from onnx import TensorProto

    if table.dtype.name == "bfloat16":
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            table.view(np.uint16), TensorProto.BFLOAT16
        )
    return ort.OrtValue.ortvalue_from_numpy(np.asarray(table))


def _create(model: bytes, so: ort.SessionOptions, device: str) -> ort.InferenceSession:
    """On ``device`` as the model's own sessions are (``sessions``): ``cuda`` refuses to
    run elsewhere, ``auto`` falls back to the CPU with a warning."""
    if device == "cpu" or CUDA not in ort.get_available_providers():
        if device == "cuda":
            raise ServerConfigError(
                f"CUDA execution provider not available for the head graph (onnxruntime "
                f"{ort.__version__} offers {ort.get_available_providers()})"
            )
        return ort.InferenceSession(model, so, providers=[CPU])
    cuda = (CUDA, {"use_tf32": "0"})
    try:
        session = ort.InferenceSession(model, so, providers=[cuda, CPU])
    except Exception as exc:
        if device == "cuda":
            raise ServerConfigError(f"cannot run the head graph on CUDA: {exc}") from exc
        logger.warning("the head graph cannot run on CUDA (%s); it runs on the CPU", exc)
        return ort.InferenceSession(model, so, providers=[CPU])
    if device == "cuda" and session.get_providers()[0] != CUDA:
        raise ServerConfigError(
            f"asked for CUDA but onnxruntime runs the head graph on {session.get_providers()}"
        )
    return session
