"""Loading one model directory: check it, choose its backend, compute what it needs.

The backend is decided here, once per model, by its kind (``BACKENDS``), and reported
in GetModelInfo and the logs. For a ``token`` model:
- ``table`` on CPU when the model's ``[V, D]`` float32 rows fit ``float32_table_max_bytes``:
  the model runs once over the whole vocabulary and look-ups slice its rows (a float16
  table too when it fits ``float16_table_max_bytes``; else float16 answers are cast);
  models whose files are byte for byte the same (an encoder's and a decoder's entrance
  exported from one tied matrix) share these tables (``_RowTables``);
- ``onnxruntime`` otherwise, and on CUDA: the model runs for every batch.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
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
from tokembed.server.core.dtypes import FLOAT32, DType
from tokembed.server.core.errors import ServerConfigError
from tokembed.server.settings import Settings

logger = logging.getLogger(__name__)

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
    if settings.float32_table_bytes(vocab_size, d_model) and expects_cpu(settings.device):
        with _ROW_TABLES.lock:
            tables = _row_tables(model, settings, at_load, casts)
        if tables is not None:
            return TableBackend(
                tables, casts=casts, padding_id=manifest.padding_idx, execution_provider=CPU
            )
    per_batch = dataclasses.replace(
        at_load, cpu_arena=True, batch_output_bytes=settings.max_batch_tokens * d_model * 4
    )
    session = ModelSession(model, per_batch)
    backend = OnnxRuntimeBackend(session, padding_id=manifest.padding_idx, casts=casts)
    backend.warm_up(settings.max_batch_tokens)
    return backend


class _RowTables:
    """The row tables computed at load, by the bytes they are computed from, so that two
    model directories that are byte for byte the same model hold one copy of each table.

    An encoder's and a decoder's entrance exported from one tied matrix are two model
    directories (two names) with identical files: the same graph, the same table. A
    table is the output of its model's files and nothing else (the padding id, which
    the manifest alone holds, only picks a row of it), and ``load_model_dir`` has checked
    every file against the sha256 its manifest records before any table is computed:
    equal recorded hashes of every file are equal bytes, never a guess. Held weakly: a
    table goes when the last model serving it is unloaded.
    """

    def __init__(self) -> None:
        # Held while a table is computed, so that a model loading beside its twin waits
        # for the twin's table instead of computing a second one.
        self.lock = threading.Lock()
        self._tables: weakref.WeakValueDictionary[tuple[object, ...], np.ndarray] = (
            weakref.WeakValueDictionary()
        )
        self._computed_for: dict[tuple[object, ...], Path] = {}

    @staticmethod
    def _key(model: ModelDir, dtype: DType) -> tuple[object, ...]:
        files = sorted((name, entry.sha256, entry.size_bytes)
                       for name, entry in model.manifest.files.items())  # fmt: skip
        return (model.kind.name, dtype.name, *files)

    def get(self, model: ModelDir, dtype: DType) -> tuple[np.ndarray, Path] | None:
        """The table already computed for a model with these files, and for which one."""
        key = self._key(model, dtype)
        table = self._tables.get(key)
        return None if table is None else (table, self._computed_for[key])

    def keep(self, model: ModelDir, dtype: DType, table: np.ndarray) -> np.ndarray:
        key = self._key(model, dtype)
        self._tables[key] = table
        self._computed_for[key] = model.path
        weakref.finalize(table, self._computed_for.pop, key, None)
        return table


_ROW_TABLES = _RowTables()


def _row_tables(
    model: ModelDir, settings: Settings, at_load: SessionOptions, casts: dict[DType, Cast]
) -> dict[DType, np.ndarray] | None:
    """The model's float32 rows and the cast tables its settings keep: those computed for
    a model with the same files already (``_RowTables``), else computed here. None when
    the session does not run on the CPU."""
    shared = _ROW_TABLES.get(model, FLOAT32)
    if shared is not None:
        rows, computed_for = shared
        logger.info(
            "%s: the same files as %s (by sha256); its row tables are shared, not computed again",
            model.path, computed_for,
        )  # fmt: skip
    else:
        session = ModelSession(model, at_load)
        if session.provider != CPU:
            return None
        rows = _ROW_TABLES.keep(model, FLOAT32, session.every_row(_CHUNK_BYTES))
    tables = {FLOAT32: rows}
    vocab_size, d_model = rows.shape
    for dtype, cast in casts.items():
        if settings.cast_table_bytes(vocab_size, d_model, dtype.itemsize):
            kept = _ROW_TABLES.get(model, dtype)
            tables[dtype] = (
                kept[0]
                if kept is not None
                else _ROW_TABLES.keep(model, dtype, _cast_in_chunks(rows, cast, dtype))
            )
    return tables


# How each model kind (``tokembed.export.kinds``) is served: a new kind is a row here.
BACKENDS: dict[str, Callable[[ModelDir, Settings], Backend]] = {"token": _token_backend}


def _cast_in_chunks(table: np.ndarray, cast: Cast, dtype: DType) -> np.ndarray:
    out = np.empty(table.shape, dtype=dtype.numpy)
    step = max(1, _CHUNK_BYTES // (table.shape[1] * table.itemsize))
    for start in range(0, len(table), step):
        out[start : start + step] = cast(table[start : start + step])
    return out
