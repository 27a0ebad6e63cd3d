"""onnxruntime sessions for a model: the execution provider (CPU, CUDA, or CUDA with a
fallback), thread settings, the CPU arena, and the casts from float32 to each other
output dtype (onnxruntime's Cast for float16; ml_dtypes' for bfloat16, which onnxruntime's
Python binding cannot hand back as an array).

Both backends open their sessions here: the onnxruntime backend runs the model per
batch; the table backend runs it once at load over the whole vocabulary.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from tokembed.server.core.dtypes import BFLOAT16, FLOAT32, OUTPUT_DTYPES, DType
from tokembed.server.core.errors import ServerConfigError

logger = logging.getLogger(__name__)

# What computes the rows: a cache of computed rows is keyed by it (models/table_cache).
RUNTIME_VERSION = f"onnxruntime {ort.__version__}"
CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


@dataclass(frozen=True)
class Graph:
    """A model's ONNX graph and what its model directory declares of it, read there by
    server/models/loading.py (the backends never open a model directory)."""

    path: Path
    input_name: str  # the ids
    more_names: tuple[str, ...]  # the kind's further id inputs (a segment model's types)
    output_name: str
    vocab_size: int
    d_model: int


@dataclass(frozen=True)
class SessionOptions:
    device: str = "cpu"
    intra_op_threads: int = 1
    inter_op_threads: int = 0
    # The look-up's working set: the largest batch's rows that one run computes; the CPU
    # arena keeps room for it (see ``_register_cpu_arena``). 0: onnxruntime's default arena.
    batch_output_bytes: int = 0
    # False: no CPU arena at all, for a session that only computes tables at load (every
    # allocation is then given back, instead of staying resident in the arena).
    cpu_arena: bool = True


class ModelSession:
    """``hidden_states = model(input_ids, ...)`` for ids already validated to be in range.

    The graph takes the model kind's id inputs: the ids, and any further ones
    (``Graph.more_names``: a segment model's ``token_type_ids``), each of the ids' shape;
    a further input not given runs as all zeros, as validation defaults it.

    ``run`` is synchronous and thread-safe (onnxruntime allows concurrent ``run`` calls on
    one session and releases the GIL while it computes).
    """

    def __init__(self, graph: Graph, options: SessionOptions) -> None:
        self._input_name = graph.input_name
        self._more_names = graph.more_names
        self._output_name = graph.output_name
        self.d_model = graph.d_model
        self.vocab_size = graph.vocab_size
        self.session = _create_session(graph.path, options)
        self.provider: str = self.session.get_providers()[0]
        self._run_options = _run_options(options)

    def run(self, ids: np.ndarray, more: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        """``ids``: int64 [N]; ``more``: the kind's further inputs by name, int64 [N] each
        (absent: zeros). Returns float32 [N, D], a fresh array the caller owns."""
        feed = {self._input_name: ids.reshape(1, -1)}
        for name in self._more_names:
            given = None if more is None else more.get(name)
            feed[name] = (
                np.zeros((1, ids.size), dtype=np.int64) if given is None else given.reshape(1, -1)
            )
        output = self.session.run([self._output_name], feed, self._run_options)[0]
        return output.reshape(-1, self.d_model)  # type: ignore[no-any-return]

    def every_row(self, chunk_bytes: int = 8 * 1024 * 1024) -> np.ndarray:
        """The model's row of every id: float32 ``[V, D]``, computed in chunks."""
        table = np.empty((self.vocab_size, self.d_model), dtype=np.float32)
        return self.rows_into(table, chunk_bytes)

    def rows_into(
        self,
        out: np.ndarray,
        chunk_bytes: int,
        cast: Cast | None = None,
        constants: Mapping[str, int] | None = None,
    ) -> np.ndarray:
        """The model's row of every id into ``out`` (``[V, D]``), ``chunk_bytes`` of float32
        rows at a time (so that they are never whole in memory), each chunk through
        ``cast`` if given; the kind's further inputs held at ``constants`` (absent: 0)."""
        step = max(1, chunk_bytes // (self.d_model * 4))
        for start in range(0, self.vocab_size, step):
            stop = min(self.vocab_size, start + step)
            more = {
                name: np.full(stop - start, value, dtype=np.int64)
                for name, value in (constants or {}).items()
            }
            rows = self.run(np.arange(start, stop, dtype=np.int64), more)
            out[start:stop] = rows if cast is None else cast(rows)
        return out


Cast = Callable[[np.ndarray], np.ndarray]


class OutputCast:
    """float32 rows -> another output dtype, rounding to nearest even as numpy's ``astype``
    does; onnxruntime's Cast is vectorised, and several times faster than ``astype``.
    Always on CPU: the rows are on the CPU by the time they are cast."""

    def __init__(self, dtype: DType, options: SessionOptions) -> None:
        from onnx import TensorProto, helper

        target = helper.np_dtype_to_tensor_dtype(dtype.numpy)
        graph = helper.make_graph(
            [helper.make_node("Cast", ["x"], ["y"], to=target)],
            f"tokembed_{dtype.name}_cast",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
            [helper.make_tensor_value_info("y", target, None)],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        model.ir_version = 8
        self._session = ort.InferenceSession(
            model.SerializeToString(), session_options(options), providers=[CPU]
        )
        self._run_options = _run_options(options)

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        output = self._session.run(None, {"x": rows}, self._run_options)[0]
        return output  # type: ignore[no-any-return]


class BFloat16Cast:
    """float32 rows -> bfloat16, rounding to nearest even (ml_dtypes' cast). onnxruntime's
    own Cast rounds so too, but its Python
    binding has no array type for a bfloat16 output. Rounding to nearest even is what
    torch does, bit for bit: tests/server/test_answer_casts.py compares every bfloat16
    times the scale, ties and subnormals among random float32 values, and the overflows.

    NaN never reaches it: the exporter refuses a table whose answers are not finite (its
    parity check), and ml_dtypes would keep a NaN's sign where torch's bfloat16 multiply
    gives 0x7FC0. Finite float32 values past bfloat16's largest round to infinity, as in
    torch."""

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        return rows.astype(BFLOAT16.numpy)


def output_casts(options: SessionOptions) -> dict[DType, Cast]:
    """A cast for every output dtype but float32 (which the model computes)."""
    return {
        dtype: BFloat16Cast() if dtype == BFLOAT16 else OutputCast(dtype, options)
        for dtype in OUTPUT_DTYPES.values()
        if dtype != FLOAT32
    }


def available_providers() -> list[str]:
    return list(ort.get_available_providers())


def expects_cpu(device: str) -> bool:
    """Whether a session for ``device`` will run on the CPU provider, as far as can be
    known before creating it (``_create_session`` falls back to CPU for "auto" when CUDA
    is not offered; a CUDA start that fails later also falls back, unforeseen here)."""
    return device == "cpu" or (device == "auto" and CUDA not in available_providers())


_arena_lock = threading.Lock()
_arena_initial_bytes: int | None = None


def _register_cpu_arena(initial_bytes: int, max_extend_bytes: int) -> None:
    """One CPU arena for the process, shared by every session that asks for it.

    Without an arena every look-up's output is fresh zero-filled pages, which makes a
    large look-up several times slower. onnxruntime's default arena keeps those
    pages, but it never gives any back: the answers in flight live in it (the rows are
    handed to Python without a copy), so it grows, in power-of-two regions, to the largest
    set of answers ever in flight at once, and resident memory climbed in steps through a
    soak. This arena starts with one region
    that holds a full batch (reused, so the common case stays fast); the regions it adds
    under a burst are given back once they are empty (``_run_options``).

    The first call fixes the size for the process (onnxruntime registers one allocator
    per device); later calls reuse it.
    """
    global _arena_initial_bytes
    with _arena_lock:
        if _arena_initial_bytes is None:
            memory = ort.OrtMemoryInfo(
                "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
            )
            config = ort.OrtArenaCfg(
                {
                    "max_mem": 0,  # no cap: admission control bounds what is in flight
                    "arena_extend_strategy": 0,  # next power of two
                    "initial_chunk_size_bytes": initial_bytes,
                    "max_dead_bytes_per_chunk": -1,
                    "initial_growth_chunk_size_bytes": -1,
                    "max_power_of_two_extend_bytes": max_extend_bytes,
                }
            )
            ort.create_and_register_allocator(memory, config)
            _arena_initial_bytes = initial_bytes
        elif _arena_initial_bytes != initial_bytes:
            logger.debug(
                "CPU arena already registered with %d bytes; %d asked for",
                _arena_initial_bytes,
                initial_bytes,
            )


def _run_options(options: SessionOptions) -> ort.RunOptions:
    run_options = ort.RunOptions()
    if options.cpu_arena and options.batch_output_bytes > 0:
        # After each run, free the arena regions added beyond the first once they hold no
        # live answer: resident memory falls back after a burst instead of keeping its peak.
        run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return run_options


def session_options(options: SessionOptions) -> ort.SessionOptions:
    """onnxruntime's options for a session of ``options``: threads, arena, no spinning."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = options.intra_op_threads
    so.inter_op_num_threads = options.inter_op_threads
    if not options.cpu_arena:
        so.enable_cpu_mem_arena = False
    elif options.batch_output_bytes > 0:
        # Room for a batch's rows twice: the Gather's result and the scaled output.
        _register_cpu_arena(2 * options.batch_output_bytes, options.batch_output_bytes)
        so.add_session_config_entry("session.use_env_allocators", "1")
    # Idle onnxruntime threads spin by default, burning the cores gRPC needs.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return so


def _create_session(graph: Path, options: SessionOptions) -> ort.InferenceSession:
    so = session_options(options)
    # The graphs are a few Gathers, a Mul and an Add (a factorized model's MatMul): little
    # to fuse, and a fixed graph keeps the results those of the export-time parity check.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    path = str(graph)
    if options.device == "cpu":
        return ort.InferenceSession(path, so, providers=[CPU])
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
        return ort.InferenceSession(path, so, providers=[CPU])
    try:
        session = ort.InferenceSession(path, so, providers=[CUDA, CPU])
    except Exception as exc:
        if options.device == "cuda":
            raise ServerConfigError(f"cannot start the CUDA execution provider: {exc}") from exc
        logger.warning("CUDA execution provider failed (%s); falling back to CPU", exc)
        return ort.InferenceSession(path, so, providers=[CPU])
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
