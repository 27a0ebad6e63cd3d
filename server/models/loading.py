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
  type) (``backends.segment`` says why); models whose files are byte for byte the same
  (an encoder's and a decoder's entrance exported from one tied matrix) share these
  tables, and a bfloat16 model's session (``_Shared``); and processes serving models
  with the same files (the workers of ``--workers N``, a server started again) map each
  table from one file of the table cache, computed by the first of them
  (``table_cache``);
- ``onnxruntime`` otherwise, and on CUDA: the model runs for every batch (for a factorized
  model a matmul, which is why requests batch).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from tokembed import __version__
from tokembed.export.errors import ModelDirError
from tokembed.export.kinds import FACTORIZED, SEGMENT, TOKEN, TOKEN_TYPE_IDS
from tokembed.export.model_dir import ModelDir, load_model_dir
from tokembed.server.backends import segment, sessions
from tokembed.server.backends.base import Backend
from tokembed.server.backends.head import FinalNorm, NearestHead
from tokembed.server.backends.head_session import HeadGraph, HeadSession
from tokembed.server.backends.runtime import OnnxRuntimeBackend
from tokembed.server.backends.segment import SegmentTableBackend, every_combination
from tokembed.server.backends.sessions import (
    CPU,
    CUDA,
    RUNTIME_VERSION,
    Cast,
    Graph,
    ModelSession,
    SessionOptions,
    expects_cpu,
    output_casts,
)
from tokembed.server.backends.table import TableBackend
from tokembed.server.backends.tokenizer import TextTokenizer
from tokembed.server.core import dtypes as core_dtypes
from tokembed.server.core.dtypes import BFLOAT16, FLOAT32, OUTPUT_DTYPES, DType
from tokembed.server.core.errors import ServerConfigError
from tokembed.server.core.repository import ModelSet
from tokembed.server.models.table_cache import TableCache
from tokembed.server.process.settings import Settings

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Tables are computed (and cast) this many bytes of rows at a time, so that loading needs
# no second full-size temporary.
_CHUNK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class LoadedModel:
    model: ModelDir
    backend: Backend
    load_s: float  # opening the session, computing the tables or warming up
    tokenizer: TextTokenizer | None = None  # the model's own, when its directory has one


# What the server loads each model directory with; tests wrap the backend of the real
# one to hold or fail its look-ups.
ModelLoader = Callable[[Path, Settings], LoadedModel]


def check_model_dirs(directories: Sequence[Path], default_model: str | None) -> None:
    """What can be known of the model directories before the server binds its port (all
    but the files' sha256, which the load checks): each one valid, their names distinct,
    the default one of them (``core.repository.ModelSet``'s rules). Raises
    ``ServerConfigError`` naming the fault."""
    given = ModelSet(default_model)
    for directory in directories:
        try:
            name = load_model_dir(directory, verify_hashes=False).manifest.name
        except ModelDirError as exc:
            raise ServerConfigError(f"invalid model directory: {exc}") from exc
        given.add(name, directory)
    if directories:  # none: the built-in default model, whose name is checked as it loads
        given.check_default()


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
    tokenizer = _tokenizer(model, settings)
    return LoadedModel(model, backend, time.perf_counter() - started, tokenizer)


def _tokenizer(model: ModelDir, settings: Settings) -> TextTokenizer | None:
    """The model's tokenizer (its file was hashed with the rest), truncating at the
    model's own limit, else at the server's per request."""
    path, spec = model.tokenizer_path, model.manifest.tokenizer
    if path is None or spec is None:
        return None
    try:
        tokenizer = TextTokenizer(path, spec.max_length or settings.max_tokens_per_request)
    except Exception as exc:  # the library raises Exception for a file it cannot read
        message = " ".join(str(exc).split())
        raise ServerConfigError(
            f"{path}: the tokenizers library cannot load it ({message})"
        ) from exc
    if tokenizer.vocab_size > model.manifest.vocab_size:
        raise ServerConfigError(
            f"{path}: its ids reach {tokenizer.vocab_size - 1}, past the table's "
            f"{model.manifest.vocab_size} rows"
        )
    return tokenizer


def _backend(model: ModelDir, settings: Settings) -> Backend:
    build = BACKENDS.get(model.kind.name)
    if build is None:  # This is a bug: a kind model_dir knows must have a backend.
        raise ServerConfigError(f"no backend serves {model.kind.name} models yet")
    backend = build(model, settings)
    if model.manifest.head is not None:
        backend.head = _head(model, backend, settings)
    return backend


def _head(model: ModelDir, backend: Backend, settings: Settings) -> NearestHead:
    """The model's head (``nearest``): its output table in its stored dtype, and its final
    norm. The table is the look-up's own when the backend holds one of the same bytes (a
    tied model of scale 1: one copy serves both ways), else the file its head graph names,
    memory-mapped. The multiply runs in numpy on the CPU, or through the head graph in
    onnxruntime (``Settings.nearest_head``: by default where the model runs on CUDA)."""
    from tokembed.export.head import head_table, norm_arrays

    manifest = model.manifest
    assert manifest.head is not None, "This is a bug."
    arrays = norm_arrays(model.path, manifest)
    norm = None
    if arrays is not None:
        bias = None if arrays.bias is None else np.asarray(arrays.bias, dtype=np.float32)
        norm = FinalNorm(arrays.record.kind, arrays.record.eps,
                         np.asarray(arrays.weight, dtype=np.float32), bias)  # fmt: skip
    stored = head_table(model.path, manifest)
    held = backend.held_table(manifest.head.weight_dtype)
    shared = held is not None and _same_bytes(held, stored)
    table = held.view(stored.dtype) if held is not None and shared else stored
    graph = None
    if _head_runs_graph(settings.nearest_head, backend.execution_provider):
        options = SessionOptions(
            device=settings.device,
            intra_op_threads=settings.intra_op_threads,
            inter_op_threads=settings.inter_op_threads,
        )
        graph = HeadSession(HeadGraph(model.path / manifest.head.graph), table, options)
    return NearestHead(
        table, norm, manifest.head.table, shared=shared, graph=graph,
        first_pass=settings.nearest_first_pass, threads=settings.intra_op_threads,
    )  # fmt: skip


def _head_runs_graph(nearest_head: str, execution_provider: str) -> bool:
    """Whether the head's multiply runs through its graph in onnxruntime: asked for, or
    ``auto`` where the model runs on CUDA (on the CPU numpy holds no copy of the table,
    where onnxruntime's session holds two: docs/benchmarks/README.md#nearest)."""
    if nearest_head == "auto":
        return execution_provider == CUDA
    return nearest_head == "onnxruntime"


def _same_bytes(held: np.ndarray, stored: np.ndarray) -> bool:
    """Whether two ``[V, D]`` tables hold the same bytes (compared a slice at a time)."""
    if held.shape != stored.shape or held.itemsize != stored.itemsize:
        return False
    step = max(1, _CHUNK_BYTES // max(1, stored.shape[1] * stored.itemsize))
    for start in range(0, len(stored), step):
        a = held[start : start + step].view(np.uint8)
        b = np.asarray(stored[start : start + step]).view(np.uint8)
        if not np.array_equal(a, b):
            return False
    return True


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
    # back (an arena kept memory resident that no look-up used afterwards).
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
        if manifest.weight_dtype == BFLOAT16.name and model.kind.name != TOKEN:
            # Its tables would be rows cast a chunk at a time by id: a token model's.
            raise ServerConfigError(
                f"a {model.kind.name} model with bfloat16 weights cannot be served yet"
            )
        runs: ModelSession | None = None
        with _SHARED.lock:
            tables = _row_tables(
                model, [OUTPUT_DTYPES[name] for name in kept], at_load, casts, compute_rows,
                (table_rows, d_model), TableCache.open(settings.table_cache_path,
                                                       settings.table_cache_max_bytes),
            )  # fmt: skip
            if tables is not None and FLOAT32 not in tables:
                # No float32 table (a bfloat16 model): the model stays to run for answers
                # in other dtypes, a session its twins share too.
                found = _SHARED.get(model, "session")
                runs = found[0] if found is not None else ModelSession(graph_of(model), per_batch)
                _SHARED.keep(model, "session", runs)
        if tables is not None:
            table = TableBackend(
                tables,
                casts=casts,
                padding_id=manifest.padding_idx,
                execution_provider=CPU,
                session=runs,
                mapped_bytes=model.weight_bytes if runs is not None else 0,
            )
            backend = table if wrap is None else wrap(table)
            backend.serving_memory = serving_memory
            return backend
    runtime = OnnxRuntimeBackend(
        ModelSession(graph_of(model), per_batch),
        padding_id=manifest.padding_idx,
        casts=casts,
        memory={"weights": model.weight_bytes, "batch arena": 2 * batch_output_bytes},
    )
    runtime.warm_up(settings.max_batch_tokens)
    runtime.serving_memory = serving_memory
    return runtime


def _table_way_bytes(settings: Settings, rows: int, d_model: int, model: ModelDir) -> int:
    """What serving from tables would take, whether or not they fit their budgets: the
    tables ``Settings.tables`` would keep (the model's own table's budget aside), and for
    a bfloat16 model the weights mapped for its other answers."""
    kept = settings.tables(rows, d_model, model.manifest.weight_dtype, main_fits=True)
    # No float32 table (a bfloat16 model): the model stays mapped to run for the others.
    return sum(kept.values()) + (0 if FLOAT32.name in kept else model.weight_bytes)


def graph_of(model: ModelDir) -> Graph:
    """What a session runs of ``model``: its graph, and the names and sizes its manifest
    declares (the kind's inputs in order)."""
    manifest = model.manifest
    return Graph(
        path=model.model_path,
        input_name=manifest.input.name,
        more_names=tuple(spec.name for spec in model.kind.inputs(manifest)[1:]),
        output_name=manifest.output.name,
        vocab_size=manifest.vocab_size,
        d_model=manifest.d_model,
    )


class _Shared:
    """What loading computes for a model, by the bytes it is computed from, so that two
    model directories that are byte for byte the same model hold one copy of it: each
    row table, and the session a bfloat16 model keeps to run.

    An encoder's and a decoder's entrance exported from one tied matrix are two model
    directories (two names) with identical files: the same graph, the same table. A
    table is the output of its model's files and nothing else (the padding id, which
    the manifest alone holds, only picks a row of it), and ``load_model_dir`` has checked
    every file against the sha256 its manifest records before anything is computed:
    equal recorded hashes of every file are equal bytes, never a guess. Held weakly: what
    is shared goes when the last model using it is unloaded.
    """

    def __init__(self) -> None:
        # Held while tables are computed, so that a model loading beside its twin waits
        # for the twin's tables instead of computing a second set.
        self.lock = threading.Lock()
        self._kept: weakref.WeakValueDictionary[tuple[object, ...], Any] = (
            weakref.WeakValueDictionary()
        )
        self._computed_for: dict[tuple[object, ...], Path] = {}

    @staticmethod
    def _key(model: ModelDir, what: str) -> tuple[object, ...]:
        files = sorted((name, entry.sha256, entry.size_bytes)
                       for name, entry in model.manifest.files.items())  # fmt: skip
        return (model.kind.name, what, *files)

    def get(self, model: ModelDir, what: str) -> tuple[Any, Path] | None:
        """What was computed for a model with these files already, and for which one."""
        key = self._key(model, what)
        kept = self._kept.get(key)
        return None if kept is None else (kept, self._computed_for[key])

    def keep(self, model: ModelDir, what: str, value: T) -> T:
        key = self._key(model, what)
        if key not in self._kept:
            self._kept[key] = value
            self._computed_for[key] = model.path
            weakref.finalize(value, self._computed_for.pop, key, None)
        return value


_SHARED = _Shared()


def _row_tables(
    model: ModelDir,
    dtypes: list[DType],
    at_load: SessionOptions,
    casts: dict[DType, Cast],
    compute_rows: Callable[[ModelSession], np.ndarray],
    shape: tuple[int, int],
    cache: TableCache | None,
) -> dict[DType, np.ndarray] | None:
    """The model's ``shape`` row tables in ``dtypes``: those computed for a model with the
    same files already, in this process (``_Shared``) or in the table cache (any process,
    ``table_cache``: mapped from its file), else computed here (the float32 rows by the
    model and the others cast from them; without float32, a bfloat16 model, each the
    model's rows cast a chunk at a time) and written to the cache. None when the session
    does not run on the CPU."""
    tables: dict[DType, np.ndarray] = {}
    session: ModelSession | None = None
    shared_with: Path | None = None
    not_on_cpu = False

    def compute(dtype: DType) -> np.ndarray | None:
        nonlocal session, not_on_cpu
        if dtype != FLOAT32 and FLOAT32 in tables:
            return _cast_in_chunks(tables[FLOAT32], casts[dtype], dtype)
        if session is None:
            session = ModelSession(graph_of(model), at_load)
            if session.provider != CPU:
                not_on_cpu = True
                return None
        if dtype == FLOAT32:
            rows = compute_rows(session)
            # The other tables are cast from these rows: the session (and the weights it
            # holds) goes now, not beside them (a swap's peak is the new tables).
            session = None
            return rows
        return _rows_in(session, casts[dtype], dtype)

    for dtype in sorted(dtypes, key=lambda d: d != FLOAT32):  # the others cast from float32
        found = _SHARED.get(model, dtype.name)
        if found is not None:
            tables[dtype], shared_with = found
            continue
        if cache is None:
            rows = compute(dtype)
        else:
            key = _cache_key(model, dtype, shape, at_load)
            rows = cache.rows(key, shape, np.dtype(dtype.numpy), functools.partial(compute, dtype))
        if rows is None or not_on_cpu:
            return None
        tables[dtype] = _SHARED.keep(model, dtype.name, rows)
    if shared_with is not None:
        logger.info(
            "%s: the same files as %s (by sha256); its row tables are shared, not computed again",
            model.path, shared_with,
        )  # fmt: skip
    return tables


def _cache_key(
    model: ModelDir, dtype: DType, shape: tuple[int, int], at_load: SessionOptions
) -> dict[str, object]:
    """Everything a table's rows are computed from, which names its file in the table
    cache: the model's files (``_Shared``'s key), the kind and the shape of its rows (the
    manifest's sizes, which the manifest alone holds), the dtype and the weights' (which
    choose how the rows are cast), and what computes them: this code's version, the
    runtime's and how it is run (threads, the rows per run), and the code that computes
    and casts them (``_code_digest``)."""
    manifest = model.manifest
    return {
        "kind": model.kind.name,
        "files": sorted(
            [name, entry.sha256, entry.size_bytes] for name, entry in manifest.files.items()
        ),
        "shape": list(shape),
        "dtype": dtype.name,
        "weight_dtype": manifest.weight_dtype,
        "tokembed": __version__,
        "code": _code_digest(),
        "runtime": RUNTIME_VERSION,
        "intra_op_threads": at_load.intra_op_threads,
        "chunk_bytes": _CHUNK_BYTES,
    }


@functools.cache
def _code_digest() -> str:
    """The sha256 of the source of the modules that compute and cast the rows, and of the
    libraries' versions they use: a cached table computed by other code (a server built
    from a checkout that changed a cast) is not this code's, whatever the package's
    version says."""
    digest = hashlib.sha256()
    for module in (sys.modules[__name__], sessions, segment, core_dtypes):
        digest.update(Path(str(module.__file__)).read_bytes())
    try:
        ml_dtypes_version = importlib.metadata.version("ml_dtypes")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a dependency
        ml_dtypes_version = "unknown"
    digest.update(f"numpy {np.__version__}; ml_dtypes {ml_dtypes_version}".encode())
    return digest.hexdigest()


# How each model kind (``tokembed.export.kinds``) is served: a new kind is a row here.
BACKENDS: dict[str, Callable[[ModelDir, Settings], Backend]] = {
    TOKEN: _token_backend,
    SEGMENT: _segment_backend,
    FACTORIZED: _token_backend,
}


def _rows_in(session: ModelSession, cast: Cast, dtype: DType) -> np.ndarray:
    """The model's rows of every id cast to ``dtype`` (the float32 rows are never whole
    in memory)."""
    out = np.empty((session.vocab_size, session.d_model), dtype=dtype.numpy)
    return session.rows_into(out, _CHUNK_BYTES, cast)


def _cast_in_chunks(table: np.ndarray, cast: Cast, dtype: DType) -> np.ndarray:
    out = np.empty(table.shape, dtype=dtype.numpy)
    step = max(1, _CHUNK_BYTES // (table.shape[1] * table.itemsize))
    for start in range(0, len(table), step):
        out[start : start + step] = cast(table[start : start + step])
    return out
