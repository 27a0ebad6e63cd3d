"""The onnxruntime session: one look-up of a flat id array, nothing about batching.

``run`` is synchronous and thread-safe (onnxruntime allows concurrent ``run`` calls on
one session and releases the GIL while it computes); callers put it on an executor.
On CPU the look-ups may come from a float32 table instead (``keep_float32_table``): a
numpy gather of rows computed with the model at load, bit-identical, faster than the
onnxruntime run, and like it free of the GIL while it copies (numpy releases it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
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
    # The look-up's working set: the largest batch's rows that one run computes; the CPU
    # arena keeps room for it (see ``_register_cpu_arena``). 0: onnxruntime's default arena.
    batch_output_bytes: int = 0
    # False: no CPU arena at all, for a runtime that only computes the row tables at load
    # (every allocation is then given back, instead of staying resident in the arena).
    cpu_arena: bool = True


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
        self._run_options = _run_options(options)
        self._batch_output_bytes = options.batch_output_bytes
        self._float32_table: np.ndarray | None = None

    def to_float16(self, rows: np.ndarray) -> np.ndarray:
        """float32 -> float16, round to nearest even, as numpy's ``astype`` does; onnxruntime's
        Cast is vectorised (8.5 ms for 33.5 MB here, against 25-44 ms for ``astype``)."""
        output = self._caster.run(None, {"x": rows}, self._run_options)[0]
        return output  # type: ignore[no-any-return]

    def float16_table(self, chunk_bytes: int = 8 * 1024 * 1024) -> np.ndarray:
        """Every row, looked up with the model and rounded to float16: ``[V, D]``.

        Computed with the same two steps a float16 request takes (the look-up, then the
        cast), so serving float16 from it is bit-identical, at half the bytes to gather.
        The look-up's rows come from the float32 table when one is kept (no second pass
        of the model over the vocabulary).
        """
        return self._every_row(np.float16, self.to_float16, chunk_bytes)

    def keep_float32_table(self, chunk_bytes: int = 8 * 1024 * 1024) -> None:
        """From now on, answer every look-up from a ``[V, D]`` float32 table of all rows,
        computed here with the model (so bit-identical; its chunked runs also warm the
        session up).

        Why, measured here at D=512: a numpy gather of the table against the onnxruntime
        run of the same ids took 0.075 against 0.22 ms for 512 ids and 6.2 against
        10.5 ms for 16384 (the graph gathers, then scales: two passes over the rows, and
        the answer is copied out of onnxruntime). Inside a busy server the gap is larger
        for a few ids: 110-150 us more server CPU per [1,8] request with onnxruntime,
        most likely spent winning the GIL back from gRPC's threads. And the answers no
        longer live in onnxruntime's arena, whose first region (two full batches) would
        otherwise be resident for good.
        """
        self._float32_table = None  # the rows come from the model, not from an older table
        self._float32_table = self._every_row(np.float32, lambda rows: rows, chunk_bytes)

    @property
    def float32_table(self) -> np.ndarray | None:
        """The ``[V, D]`` table look-ups are answered from, if kept (read it, never write)."""
        return self._float32_table

    @property
    def float32_table_bytes(self) -> int:
        return 0 if self._float32_table is None else int(self._float32_table.nbytes)

    def _every_row(
        self,
        dtype: type[np.floating],
        convert: Callable[[np.ndarray], np.ndarray],
        chunk_bytes: int,
    ) -> np.ndarray:
        vocab = self.model.manifest.vocab_size
        source = self._float32_table
        table = np.empty((vocab, self.d_model), dtype=dtype)
        step = max(1, chunk_bytes // (self.d_model * 4))
        for start in range(0, vocab, step):
            stop = min(vocab, start + step)
            ids = np.arange(start, stop, dtype=np.int64)
            rows = source[start:stop] if source is not None else self._run_session(ids)
            table[start:stop] = convert(rows)
        return table

    def run(self, ids: np.ndarray) -> np.ndarray:
        """``ids``: int64 [N]. Returns float32 [N, D], a fresh array the caller owns."""
        table = self._float32_table
        if table is not None:
            return table.take(ids, axis=0)  # the method: np.take's Python wrapper costs more
        return self._run_session(ids)

    def _run_session(self, ids: np.ndarray) -> np.ndarray:
        output = self.session.run(
            [self.output_name], {self.input_name: ids.reshape(1, -1)}, self._run_options
        )[0]
        return output.reshape(-1, self.d_model)  # type: ignore[no-any-return]

    def warm_up(self) -> float:
        """A small, a larger and a full-batch run, so the first request pays no allocation
        cost. The full batch also touches every page of the arena's first region, so the
        resident memory it adds is there from the start rather than creeping up under load
        as the arena spreads answers over it (which the soak saw as +6% growth)."""
        started = time.perf_counter()
        vocab = self.model.manifest.vocab_size
        full_batch = self._batch_output_bytes // (4 * self.d_model)
        for size in (8, 4096, full_batch):
            if size <= 0:
                continue
            ids = np.arange(size, dtype=np.int64) % vocab
            self._run_session(ids)
        return time.perf_counter() - started


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

    Without an arena every look-up's output is fresh zero-filled pages: a [32,512] look-up
    at D=512 takes 31 ms instead of 9 ms here. onnxruntime's default arena keeps those
    pages, but it never gives any back: the answers in flight live in it (the rows are
    handed to Python without a copy), so it grows, in power-of-two regions, to the largest
    set of answers ever in flight at once, and resident memory climbed in steps through a
    soak (+8 to +12% from the first third to the last). This arena starts with one region
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


def _run_options(options: RuntimeOptions) -> ort.RunOptions:
    run_options = ort.RunOptions()
    if options.cpu_arena and options.batch_output_bytes > 0:
        # After each run, free the arena regions added beyond the first once they hold no
        # live answer: resident memory falls back after a burst instead of keeping its peak.
        run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return run_options


def _session_options(options: RuntimeOptions) -> ort.SessionOptions:
    session_options = ort.SessionOptions()
    session_options.intra_op_num_threads = options.intra_op_threads
    session_options.inter_op_num_threads = options.inter_op_threads
    if not options.cpu_arena:
        session_options.enable_cpu_mem_arena = False
    elif options.batch_output_bytes > 0:
        # Room for a batch's rows twice: the Gather's result and the scaled output.
        _register_cpu_arena(2 * options.batch_output_bytes, options.batch_output_bytes)
        session_options.add_session_config_entry("session.use_env_allocators", "1")
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
