"""The nearest section of ``tokembed bench`` (``--nearest``): the way back against its
references, measured in one run.

Per table dtype (float32, bfloat16), a synthetic model (V x D, seeded; by default
Llama-3's 128,256 x 4,096) with a tied head is written once into the cache and served by
``tokembed serve``; then:

- **memory floor**: the table's bytes / the bandwidth of an in-process read of the same
  table (this process, the stored bytes: a streaming xor of its 8-byte words, the fastest
  of five reads before the service's turn and five after);
- **one vector**: p50 latency of ``nearest(1 vector, k=1)`` through the real client and
  server, against that floor (target: <= 1.5x);
- **16 callers x 8 vectors**: vectors/s of 16 concurrent asyncio callers, against the
  vectors/s of one in-process multiply of the same 128 rows with the same library (numpy,
  float32, the table widened to float32 whole: numpy's fastest multiply, though the server
  holds no widened copy; target: >= 0.7x).

With ``heads`` (``--nearest-heads numpy,onnxruntime``) the service is measured once per
``--nearest-head``, in turns, against the same floor and multiply: which of numpy and the
head graph in onnxruntime runs the CPU's multiply faster (what ``auto`` picks on the CPU).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokembed.bench import processes

LLAMA_VOCAB, LLAMA_D = 128256, 4096
CALLERS, VECTORS_EACH = 16, 8
ONE_VECTOR_TARGET, CALLERS_TARGET = 1.5, 0.7


@dataclass(frozen=True)
class NearestFigures:
    dtype: str
    head: str  # the service's --nearest-head
    vocab_size: int
    d_model: int
    table_bytes: int
    read_s: float  # the in-process read of the table (fastest of five)
    one_vector_p50_s: float
    callers_vectors_per_s: float
    in_process_vectors_per_s: float

    @property
    def floor_s(self) -> float:
        return self.read_s

    @property
    def one_vector_ratio(self) -> float:
        return self.one_vector_p50_s / self.floor_s

    @property
    def callers_ratio(self) -> float:
        return self.callers_vectors_per_s / self.in_process_vectors_per_s


def ensure_nearest_model(cache_dir: Path, vocab_size: int, d_model: int, dtype: str) -> Path:
    """A seeded ``[V, D]`` table (the built-in model's values) stored in ``dtype``, scale
    1, with a tied head: written once, then reused."""
    import shutil

    from tokembed.export.errors import ModelDirError
    from tokembed.export.head import add_head
    from tokembed.export.model_dir import load_model_dir

    directory = cache_dir / f"nearest-v{vocab_size}-d{d_model}-{dtype}"
    try:
        if load_model_dir(directory, verify_hashes=False).manifest.head is not None:
            return directory
    except ModelDirError:
        pass
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    _write_model(directory, vocab_size, d_model, dtype)
    add_head(directory, output_table=None, output_key=None, norm=None)
    return directory


def _write_model(directory: Path, vocab_size: int, d_model: int, dtype: str) -> None:
    import onnxruntime as ort

    from tokembed.export.builtin import seeded_table
    from tokembed.export.dtypes import WEIGHT_DTYPES
    from tokembed.export.graphs import DATA_NAME, write_token_graph
    from tokembed.export.manifest import (
        INPUT_NAME,
        MODEL_NAME,
        OUTPUT_NAME,
        Manifest,
        Parity,
        TensorSpec,
    )  # fmt: skip
    from tokembed.export.staging import file_entries, producer_versions

    stored = seeded_table(vocab_size, d_model, 0).astype(WEIGHT_DTYPES[dtype].numpy)
    stored.tofile(directory / DATA_NAME)
    opset = write_token_graph(directory, vocab_size, d_model, dtype, 1.0)
    ids = np.array([[0, vocab_size - 1], [1, vocab_size // 2]], dtype=np.int64)
    session = ort.InferenceSession(str(directory / MODEL_NAME), providers=["CPUExecutionProvider"])
    got = session.run([OUTPUT_NAME], {INPUT_NAME: ids})[0]
    error = float(np.abs(got - stored[ids].astype(np.float32)).max())
    if error:
        raise RuntimeError(f"this is a bug: the bench model's graph differs by {error}")
    Manifest(
        name=f"nearest-{dtype}", version="1", vocab_size=vocab_size, d_model=d_model, scale=1.0,
        padding_idx=None, weight_dtype=dtype,
        input=TensorSpec(INPUT_NAME, "int64", ["batch", "sequence"]),
        output=TensorSpec(OUTPUT_NAME, "float32", ["batch", "sequence", d_model]),
        opset=opset, files=file_entries(directory),
        producer=producer_versions(("numpy", "onnx", "onnxruntime")),
        parity=Parity(max_abs_error=error, tolerance=0.0, ids_checked=int(ids.size)),
        source={"kind": "bench", "seed": 0},
    ).write(directory)  # fmt: skip


def run_nearest(
    cache_dir: Path,
    *,
    vocab_size: int = LLAMA_VOCAB,
    d_model: int = LLAMA_D,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    duration_s: float = 10.0,
    heads: tuple[str, ...] = ("auto",),
    progress: Callable[[str], None] = print,
) -> list[NearestFigures]:
    figures = []
    for dtype in dtypes:
        directory = ensure_nearest_model(cache_dir, vocab_size, d_model, dtype)
        figures += _measure(directory, dtype, duration_s, heads, progress)
    return figures


def _measure(
    directory: Path,
    dtype: str,
    duration_s: float,
    heads: tuple[str, ...],
    progress: Callable[[str], None],
) -> list[NearestFigures]:
    from tokembed.export.head import head_table
    from tokembed.export.manifest import Manifest

    manifest = Manifest.read(directory)
    stored = np.ascontiguousarray(head_table(directory, manifest))  # in memory, as stored
    read_s = min(_read(stored) for _ in range(5))
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((CALLERS * VECTORS_EACH, manifest.d_model)).astype(np.float32)
    multiply_s = _multiply_s(stored, rows)
    progress(f"nearest {dtype}: table {stored.nbytes / 2**30:.2f} GiB, read in "
             f"{read_s * 1e3:.1f} ms ({stored.nbytes / read_s / 1e9:.1f} GB/s); one multiply "
             f"of {len(rows)} rows {multiply_s * 1e3:.1f} ms")  # fmt: skip
    table_bytes = stored.nbytes
    served = {
        head: _serve(directory, head, rows, manifest.vocab_size, duration_s) for head in heads
    }
    # Read again after the service's turn: the floor is the fastest read of the run (on a
    # loaded machine, one moment's read may be slow, which would flatter the ratio).
    read_s = min(read_s, *(_read(stored) for _ in range(5)))
    del stored
    figures = []
    for head, (latencies, callers_vectors_per_s) in served.items():
        figure = NearestFigures(
            dtype=dtype, head=head, vocab_size=manifest.vocab_size, d_model=manifest.d_model,
            table_bytes=table_bytes, read_s=read_s,
            one_vector_p50_s=statistics.median(latencies),
            callers_vectors_per_s=callers_vectors_per_s,
            in_process_vectors_per_s=len(rows) / multiply_s,
        )  # fmt: skip
        progress(f"nearest {dtype}, head {head}: one vector p50 "
                 f"{figure.one_vector_p50_s * 1e3:.1f} ms = {figure.one_vector_ratio:.2f}x the "
                 f"floor; {CALLERS} callers x {VECTORS_EACH}: "
                 f"{figure.callers_vectors_per_s:.0f} vectors/s = {figure.callers_ratio:.2f}x "
                 "one in-process multiply")  # fmt: skip
        figures.append(figure)
    return figures


def _serve(
    directory: Path, head: str, rows: np.ndarray, vocab_size: int, duration_s: float
) -> tuple[list[float], float]:
    """The service under ``--nearest-head head``: one vector's 20 latencies, and the
    vectors/s of 16 callers of 8."""
    from tokembed.client import AsyncEmbeddingClient, EmbeddingClient

    limit = str(max(128 << 20, len(rows) * vocab_size * 4))
    with processes.service(
        str(directory), "--max-output-bytes-per-request", limit, "--nearest-head", head
    ) as server:
        with EmbeddingClient(server.target, timeout_s=120) as client:
            client.nearest(rows[:1], k=1)  # the first call pays the connection
            latencies = []
            for i in range(20):
                started = time.perf_counter()
                client.nearest(rows[i : i + 1], k=1)
                latencies.append(time.perf_counter() - started)

        async def callers() -> int:
            done = 0
            stop = time.perf_counter() + duration_s
            async with AsyncEmbeddingClient(server.target, timeout_s=120) as aio:

                async def caller(index: int) -> None:
                    nonlocal done
                    mine = rows[index * VECTORS_EACH : (index + 1) * VECTORS_EACH]
                    while time.perf_counter() < stop:
                        await aio.nearest(mine, k=1)
                        done += VECTORS_EACH

                await asyncio.gather(*(caller(i) for i in range(CALLERS)))
            return done

        started = time.perf_counter()
        vectors = asyncio.run(callers())
        elapsed = time.perf_counter() - started
    return latencies, vectors / elapsed


def _multiply_s(stored: np.ndarray, rows: np.ndarray) -> float:
    """One multiply of ``rows`` by the table widened to float32 whole (numpy's matmul, the
    server's library; the server itself reads the stored dtype): the fastest of three."""
    widened = stored.astype(np.float32)
    return min(_timed(lambda: rows @ widened.T) for _ in range(3))


def _read(table: np.ndarray) -> float:
    """One read of every byte of ``table``: a streaming xor of its 8-byte words."""
    words = table.reshape(-1).view(np.uint64)
    return _timed(lambda: np.bitwise_xor.reduce(words))


def _timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def markdown(figures: list[NearestFigures], command: str) -> str:
    lines = [
        "# nearest: the way back, against its references",
        "",
        f"`{command}`",
        "",
        "| table | head | V x D | table bytes | memory floor (in-process read) | one vector p50 | "
        f"/ floor (target <= {ONE_VECTOR_TARGET}) | {CALLERS} callers x {VECTORS_EACH} "
        "vectors/s | in-process multiply vectors/s | ratio (target >= "
        f"{CALLERS_TARGET}) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        lines.append(
            f"| {f.dtype} | {f.head} | {f.vocab_size} x {f.d_model} | "
            f"{f.table_bytes / 2**30:.2f} GiB | "
            f"{f.floor_s * 1e3:.1f} ms | {f.one_vector_p50_s * 1e3:.1f} ms | "
            f"{f.one_vector_ratio:.2f} | {f.callers_vectors_per_s:.0f} | "
            f"{f.in_process_vectors_per_s:.0f} | {f.callers_ratio:.2f} |"
        )
    return "\n".join(lines) + "\n"
