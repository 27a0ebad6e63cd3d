"""Loading one model directory: check it, choose its backend, compute what it needs.

The backend is decided here, once per model, by its kind (``BACKENDS``), and reported
in GetModelInfo and the logs. For a ``token`` model:
- ``table`` on CPU when ``Settings.tables`` keeps tables for it: the model runs once over
  the whole vocabulary and look-ups slice its rows (a float32 table when it fits
  ``float32_table_max_bytes``, float16 and bfloat16 ones beside it where they fit theirs;
  a bfloat16 model keeps its bfloat16 table alone and runs for its other answers);
- ``onnxruntime`` otherwise, and on CUDA: the model runs for every batch.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokembed.export.errors import ModelDirError
from tokembed.export.model_dir import ModelDir, load_model_dir
from tokembed.server.backends.base import Backend
from tokembed.server.backends.runtime import OnnxRuntimeBackend
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
    """A ``token`` model: its table of rows, or onnxruntime per batch."""
    manifest = model.manifest
    vocab_size, d_model = manifest.vocab_size, manifest.d_model
    # The tables and casts computed at load need no arena: what they allocate is given
    # back (an arena kept 16-32 MB resident that no look-up used afterwards).
    at_load = SessionOptions(
        device=settings.device,
        intra_op_threads=settings.intra_op_threads,
        inter_op_threads=settings.inter_op_threads,
        cpu_arena=False,
    )
    casts = output_casts(at_load)
    per_batch = dataclasses.replace(
        at_load, cpu_arena=True, batch_output_bytes=settings.max_batch_tokens * d_model * 4
    )
    kept = settings.tables(vocab_size, d_model, manifest.weight_dtype)
    if kept and expects_cpu(settings.device):
        session = ModelSession(model, at_load)
        if session.provider == CPU:
            dtypes = [OUTPUT_DTYPES[name] for name in kept]
            if FLOAT32 in dtypes:
                tables = {FLOAT32: session.every_row(_CHUNK_BYTES)}
                for dtype in dtypes:
                    if dtype != FLOAT32:
                        tables[dtype] = _cast_in_chunks(tables[FLOAT32], casts[dtype], dtype)
                return TableBackend(
                    tables,
                    casts=casts,
                    padding_id=manifest.padding_idx,
                    execution_provider=session.provider,
                )
            # No float32 table (a bfloat16 model): each table is the model's rows cast a
            # chunk at a time, and the model stays to run for answers in other dtypes.
            tables = {dtype: _rows_in(session, casts[dtype], dtype) for dtype in dtypes}
            return TableBackend(
                tables,
                casts=casts,
                padding_id=manifest.padding_idx,
                execution_provider=session.provider,
                session=ModelSession(model, per_batch),
                mapped_bytes=model.weight_bytes,
            )
    session = ModelSession(model, per_batch)
    backend = OnnxRuntimeBackend(session, padding_id=manifest.padding_idx, casts=casts)
    backend.warm_up(settings.max_batch_tokens)
    return backend


# How each model kind (``tokembed.export.kinds``) is served: a new kind is a row here.
BACKENDS: dict[str, Callable[[ModelDir, Settings], Backend]] = {"token": _token_backend}


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
