"""Loading one model directory: check it, choose its backend, compute what it needs.

The backend is decided here, once per model, by its kind (``BACKENDS``), and reported
in GetModelInfo and the logs, with the memory each way of serving it takes. Every kind
has the same two ways:
- ``table`` on CPU when ``Settings.tables`` keeps tables for it: the model runs once, at
  load, over every input it can be given, and look-ups slice its rows (a float32 table
  when it fits ``float32_table_max_bytes``, float16 and bfloat16 ones beside it where they
  fit theirs; a bfloat16 model keeps its bfloat16 table alone and runs for its other
  answers). A ``token`` model's rows are ``[V, D]``; a ``factorized`` one's too (its matmul
  is done once per id, at load); a ``segment`` one's are ``[T * V, D]``, one per (id,
  type) (``backends.segment`` says why);
- ``onnxruntime`` otherwise, and on CUDA: the model runs for every batch (for a factorized
  model a matmul, which is why requests batch).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokembed.export.errors import ModelDirError
from tokembed.export.kinds import FACTORIZED, SEGMENT, TOKEN, TOKEN_TYPE_IDS
from tokembed.export.model_dir import ModelDir, load_model_dir
from tokembed.server.backends.base import Backend
from tokembed.server.backends.runtime import OnnxRuntimeBackend
from tokembed.server.backends.segment import SegmentTableBackend, every_combination
from tokembed.server.backends.sessions import (
    CPU,
    Cast,
    ModelSession,
    SessionOptions,
    expects_cpu,
    output_casts,
)
from tokembed.server.backends.table import TableBackend
from tokembed.server.core.dtypes import FLOAT32, OUTPUT_DTYPES, DType
from tokembed.server.core.errors import ServerConfigError
from tokembed.server.settings import Settings

# Tables are computed (and cast) this many bytes of rows at a time, so that loading needs
# no second full-size temporary.
_CHUNK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class LoadedModel:
    model: ModelDir
    backend: Backend
    load_s: float  # opening the session, computing the tables or warming up


# What the server loads each model directory with; tests wrap the backend of the real
# one to hold or fail its look-ups.
ModelLoader = Callable[[Path, Settings], LoadedModel]


def check_model_dirs(directories: Sequence[Path], default_model: str | None) -> None:
    """What can be known of the model directories before the server binds its port (all
    but the files' sha256, which the load checks): each one valid, their names distinct,
    the default one of them. Raises ``ServerConfigError`` naming the fault."""
    paths: dict[str, Path] = {}
    for directory in directories:
        try:
            name = load_model_dir(directory, verify_hashes=False).manifest.name
        except ModelDirError as exc:
            raise ServerConfigError(f"invalid model directory: {exc}") from exc
        if name in paths:
            raise ServerConfigError(
                f"two models are named {name!r}: {paths[name]} and {directory}; give each "
                "model directory a distinct name (tokembed export --name)"
            )
        paths[name] = directory
    if directories and default_model is not None and default_model not in paths:
        served = ", ".join(repr(name) for name in paths)
        raise ServerConfigError(
            f"default_model {default_model!r} is not one of the models served ({served})"
        )


def load_model(directory: Path, settings: Settings) -> LoadedModel:
    """Validate ``directory``, choose and build its backend (blocking)."""
    try:
        model = load_model_dir(directory)
    except ModelDirError as exc:
        raise ServerConfigError(f"invalid model directory: {exc}") from exc
    started = time.perf_counter()
    try:
        backend = _backend(model, settings)
    except ServerConfigError:
        raise
    except Exception as exc:
        # onnxruntime can still refuse a directory the checks above accept (external
        # weights cut short before the manifest was written): say so in one line, not
        # with a traceback.
        message = " ".join(str(exc).split())
        raise ServerConfigError(
            f"onnxruntime cannot load the model in {directory}: {message}"
        ) from exc
    return LoadedModel(model, backend, time.perf_counter() - started)


def _backend(model: ModelDir, settings: Settings) -> Backend:
    build = BACKENDS.get(model.kind.name)
    if build is None:  # This is a bug: a kind model_dir knows must have a backend.
        raise ServerConfigError(f"no backend serves {model.kind.name} models yet")
    return build(model, settings)


def _token_backend(model: ModelDir, settings: Settings) -> Backend:
    """A ``token`` or ``factorized`` model: its ``[V, D]`` rows, or onnxruntime per batch."""
    return _table_or_runtime(
        model, settings, model.manifest.vocab_size, lambda session: session.every_row(_CHUNK_BYTES)
    )


def _segment_backend(model: ModelDir, settings: Settings) -> Backend:
    """A ``segment`` model: its ``[T * V, D]`` rows, or onnxruntime per batch."""
    manifest = model.manifest
    types = manifest.type_vocab_size
    assert types is not None, "This is a bug: model_dir checks a segment model has T."

    def rows(session: ModelSession) -> np.ndarray:
        return every_combination(session, types, TOKEN_TYPE_IDS, _CHUNK_BYTES)

    def wrap(table: TableBackend) -> Backend:
        return SegmentTableBackend(table, manifest.vocab_size, TOKEN_TYPE_IDS)

    return _table_or_runtime(model, settings, types * manifest.vocab_size, rows, wrap)


def _table_or_runtime(
    model: ModelDir,
    settings: Settings,
    table_rows: int,
    compute_rows: Callable[[ModelSession], np.ndarray],
    wrap: Callable[[TableBackend], Backend] | None = None,
) -> Backend:
    """The table backend over ``compute_rows``' float32 ``[table_rows, D]`` (wrapped by
    ``wrap``) when ``Settings.tables`` keeps tables for it on CPU; else onnxruntime per
    batch. Either way the backend says what each way takes (``Backend.serving_memory``)."""
    manifest = model.manifest
    d_model = manifest.d_model
    # The tables and casts computed at load need no arena: what they allocate is given
    # back (an arena kept 16-32 MB resident that no look-up used afterwards).
    at_load = SessionOptions(
        device=settings.device,
        intra_op_threads=settings.intra_op_threads,
        inter_op_threads=settings.inter_op_threads,
        cpu_arena=False,
    )
    casts = output_casts(at_load)
    batch_output_bytes = settings.max_batch_tokens * d_model * 4
    per_batch = dataclasses.replace(at_load, cpu_arena=True, batch_output_bytes=batch_output_bytes)
    kept = settings.tables(table_rows, d_model, manifest.weight_dtype)
    serving_memory = {
        "table": _table_way_bytes(settings, table_rows, d_model, model),
        # The weights the session holds, and the arena's first region: room for a batch's
        # rows twice (``sessions._register_cpu_arena``), shared by the process's models.
        "onnxruntime": model.weight_bytes + 2 * batch_output_bytes,
    }
    if kept and expects_cpu(settings.device):
        session = ModelSession(model, at_load)
        if session.provider == CPU:
            dtypes = [OUTPUT_DTYPES[name] for name in kept]
            if FLOAT32 in dtypes:
                tables = {FLOAT32: compute_rows(session)}
                for dtype in dtypes:
                    if dtype != FLOAT32:
                        tables[dtype] = _cast_in_chunks(tables[FLOAT32], casts[dtype], dtype)
                table = TableBackend(
                    tables,
                    casts=casts,
                    padding_id=manifest.padding_idx,
                    execution_provider=session.provider,
                )
            else:
                # No float32 table (a bfloat16 model): each table is the model's rows cast
                # a chunk at a time, and the model stays to run for answers in other dtypes.
                if model.kind.name != TOKEN:  # the exporter writes no such model
                    raise ServerConfigError(
                        f"a {model.kind.name} model with {manifest.weight_dtype} weights "
                        "cannot be served yet"
                    )
                table = TableBackend(
                    {dtype: _rows_in(session, casts[dtype], dtype) for dtype in dtypes},
                    casts=casts,
                    padding_id=manifest.padding_idx,
                    execution_provider=session.provider,
                    session=ModelSession(model, per_batch),
                    mapped_bytes=model.weight_bytes,
                )
            backend = table if wrap is None else wrap(table)
            backend.serving_memory = serving_memory
            return backend
    runtime = OnnxRuntimeBackend(
        ModelSession(model, per_batch),
        padding_id=manifest.padding_idx,
        casts=casts,
        memory={"weights": model.weight_bytes, "batch arena": 2 * batch_output_bytes},
    )
    runtime.warm_up(settings.max_batch_tokens)
    runtime.serving_memory = serving_memory
    return runtime


def _table_way_bytes(settings: Settings, rows: int, d_model: int, model: ModelDir) -> int:
    """What serving from tables would take, whether or not they fit their budgets: the
    tables ``Settings.tables`` would keep (budgets aside), and for a bfloat16 model the
    weights mapped for its other answers."""
    cells = rows * d_model
    if model.manifest.weight_dtype == "bfloat16":
        return cells * 2 + model.weight_bytes
    budgets = (settings.float16_table_max_bytes, settings.bfloat16_table_max_bytes)
    return cells * 4 + sum(cells * 2 for budget in budgets if cells * 2 <= budget)


# How each model kind (``tokembed.export.kinds``) is served: a new kind is a row here.
BACKENDS: dict[str, Callable[[ModelDir, Settings], Backend]] = {
    TOKEN: _token_backend,
    SEGMENT: _segment_backend,
    FACTORIZED: _token_backend,
}


def _rows_in(session: ModelSession, cast: Cast, dtype: DType) -> np.ndarray:
    """The model's rows of every id cast to ``dtype``, computed a chunk at a time (the
    float32 rows are never whole in memory)."""
    out = np.empty((session.vocab_size, session.d_model), dtype=dtype.numpy)
    step = max(1, _CHUNK_BYTES // (session.d_model * 4))
    for start in range(0, session.vocab_size, step):
        stop = min(session.vocab_size, start + step)
        out[start:stop] = cast(session.run(np.arange(start, stop, dtype=np.int64)))
    return out


def _cast_in_chunks(table: np.ndarray, cast: Cast, dtype: DType) -> np.ndarray:
    out = np.empty(table.shape, dtype=dtype.numpy)
    step = max(1, _CHUNK_BYTES // (table.shape[1] * table.itemsize))
    for start in range(0, len(table), step):
        out[start : start + step] = cast(table[start : start + step])
    return out
