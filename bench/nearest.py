"""The nearest section of ``tokembed bench`` (``--nearest``): the way back against its
references, measured in one run.

Per table dtype (float32, bfloat16), a synthetic model (V x D, seeded; by default
Llama-3's 128,256 x 4,096) with a tied head is written once into the cache and served by
``tokembed serve``; then:

- **memory floor**: the table's bytes / the bandwidth of an in-process read of the same
  table (this process, the stored bytes: a streaming xor of its 8-byte words);
- **one vector**: latency of ``nearest(1 vector, k=1)`` through the real client and
  server, against that floor (target: <= 1.5x): 20 turns of one read then one call, the
  median of each;
- **16 callers x 8 vectors**: vectors/s of 16 concurrent asyncio callers, against the
  vectors/s of one in-process multiply of the same 128 rows with the same library (numpy,
  float32, the table widened to float32 whole: numpy's fastest multiply, though the server
  holds no widened copy; target: >= 0.7x): 5 turns of the callers for a fifth of the
  duration each, then one multiply; the vectors of all the turns over their time.

For a float32 table, an **int8 first pass** cell: the same one-vector turns with a second
service started with ``--nearest-first-pass int8``, against the float32 floor read in its
turns (the issue's stretch: <= 0.5x), its ids checked equal to the first service's.

Each figure is taken in turns with its reference, so that a slow moment of a shared
machine falls on both.

With ``heads`` (``--nearest-heads numpy,onnxruntime``) the service is measured once per
``--nearest-head``, one after the other, each with its own turns of the references:
which of numpy and the head graph in onnxruntime runs the CPU's multiply faster (what
``auto`` picks on the CPU, docs/benchmarks says).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tokembed.bench import processes

if TYPE_CHECKING:
    from tokembed.client import EmbeddingClient

LLAMA_VOCAB, LLAMA_D = 128256, 4096
CALLERS, VECTORS_EACH = 16, 8
# Turns taken alternately with the reference: a read of the table and one call; the
# callers for a share of the duration and one in-process multiply.
ONE_VECTOR_TURNS, CALLER_TURNS = 20, 5
ONE_VECTOR_TARGET, CALLERS_TARGET = 1.5, 0.7
INT8_TARGET = 0.5


@dataclass(frozen=True)
class NearestFigures:
    dtype: str
    head: str  # the service's --nearest-head
    vocab_size: int
    d_model: int
    table_bytes: int
    read_s: float  # the in-process read of the table (median of the turns)
    one_vector_p50_s: float
    callers_vectors_per_s: float
    in_process_vectors_per_s: float
    # The int8 first pass's one vector and the float32 floor read in its turns (a float32
    # table's; None for the others).
    int8_one_vector_p50_s: float | None = None
    int8_read_s: float | None = None

    @property
    def floor_s(self) -> float:
        return self.read_s

    @property
    def one_vector_ratio(self) -> float:
        return self.one_vector_p50_s / self.floor_s

    @property
    def int8_ratio(self) -> float | None:
        if self.int8_one_vector_p50_s is None or self.int8_read_s is None:
            return None
        return self.int8_one_vector_p50_s / self.int8_read_s

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
        figures += [_measure(directory, dtype, head, duration_s, progress) for head in heads]
    return figures


def _measure(
    directory: Path, dtype: str, head: str, duration_s: float, progress: Callable[[str], None]
) -> NearestFigures:
    from tokembed.client import AsyncEmbeddingClient, EmbeddingClient
    from tokembed.export.head import head_table
    from tokembed.export.manifest import Manifest

    manifest = Manifest.read(directory)
    stored = np.ascontiguousarray(head_table(directory, manifest))  # in memory, as stored
    _read(stored)  # the first read pays for bringing the table in
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((CALLERS * VECTORS_EACH, manifest.d_model)).astype(np.float32)
    widened = stored.astype(np.float32)  # the reference multiply's table
    table_bytes = stored.nbytes
    limit = str(max(128 << 20, len(rows) * manifest.vocab_size * 4))
    with processes.service(
        str(directory), "--max-output-bytes-per-request", limit, "--nearest-head", head
    ) as server:
        # Each figure and its reference are taken in turns, so that a slow moment of the
        # shared machine falls on both (the reference swung fivefold between runs taken
        # one after the other).
        with EmbeddingClient(server.target, timeout_s=120) as client:
            reads, latencies, want_ids = _one_vector_turns(client, stored, rows)

        async def callers(seconds: float, aio: AsyncEmbeddingClient) -> int:
            done = 0
            stop = time.perf_counter() + seconds

            async def caller(index: int) -> None:
                nonlocal done
                mine = rows[index * VECTORS_EACH : (index + 1) * VECTORS_EACH]
                while time.perf_counter() < stop:
                    await aio.nearest(mine, k=1)
                    done += VECTORS_EACH

            await asyncio.gather(*(caller(i) for i in range(CALLERS)))
            return done

        async def in_turns() -> tuple[int, float, float]:
            vectors, callers_s, multiply_s = 0, 0.0, 0.0
            async with AsyncEmbeddingClient(server.target, timeout_s=120) as aio:
                for _ in range(CALLER_TURNS):
                    started = time.perf_counter()
                    vectors += await callers(duration_s / CALLER_TURNS, aio)
                    callers_s += time.perf_counter() - started
                    multiply_s += _timed(lambda: rows @ widened.T)
            return vectors, callers_s, multiply_s

        vectors, callers_s, multiply_s = asyncio.run(in_turns())
    int8: tuple[list[float], list[float]] | None = None
    # Once per float32 table: the int8 pass runs instead of either multiply.
    if dtype == "float32" and head != "onnxruntime":
        del widened
        int8 = _int8_turns((str(directory), "--max-output-bytes-per-request", limit,
                            "--nearest-head", head), stored, rows, want_ids)  # fmt: skip
    figures = NearestFigures(
        dtype=dtype, head=head, vocab_size=manifest.vocab_size, d_model=manifest.d_model,
        table_bytes=table_bytes, read_s=statistics.median(reads),
        one_vector_p50_s=statistics.median(latencies),
        callers_vectors_per_s=vectors / callers_s,
        in_process_vectors_per_s=len(rows) * CALLER_TURNS / multiply_s,
        int8_one_vector_p50_s=None if int8 is None else statistics.median(int8[1]),
        int8_read_s=None if int8 is None else statistics.median(int8[0]),
    )  # fmt: skip
    progress(f"nearest {dtype}, head {head}: table {table_bytes / 2**30:.2f} GiB, read in "
             f"{figures.read_s * 1e3:.1f} ms (median; {table_bytes / figures.read_s / 1e9:.1f} "
             f"GB/s); one vector p50 {figures.one_vector_p50_s * 1e3:.1f} ms = "
             f"{figures.one_vector_ratio:.2f}x the floor; {CALLERS} callers x {VECTORS_EACH}: "
             f"{figures.callers_vectors_per_s:.0f} vectors/s = {figures.callers_ratio:.2f}x "
             f"one in-process multiply ({figures.in_process_vectors_per_s:.0f}/s)")  # fmt: skip
    if figures.int8_one_vector_p50_s is not None and figures.int8_ratio is not None:
        progress(f"nearest int8 first pass: one vector p50 "
                 f"{figures.int8_one_vector_p50_s * 1e3:.1f} ms = {figures.int8_ratio:.2f}x "
                 "the float32 floor read in its turns")  # fmt: skip
    return figures


def _one_vector_turns(
    client: EmbeddingClient, stored: np.ndarray, rows: np.ndarray
) -> tuple[list[float], list[float], np.ndarray]:
    """``ONE_VECTOR_TURNS`` turns of one read of the table, then one call of one vector:
    the reads' times, the calls' latencies and their ids."""
    client.nearest(rows[:1], k=1)  # the first call pays the connection
    reads, latencies, ids = [], [], []
    for i in range(ONE_VECTOR_TURNS):
        reads.append(_read(stored))
        started = time.perf_counter()
        found = client.nearest(rows[i % len(rows) : i % len(rows) + 1], k=1)
        latencies.append(time.perf_counter() - started)
        ids.append(found.ids)
    return reads, latencies, np.concatenate(ids)


def _int8_turns(
    server_args: tuple[str, ...], stored: np.ndarray, rows: np.ndarray, want: np.ndarray
) -> tuple[list[float], list[float]]:
    """The one-vector turns of a service whose head finds its candidates in an int8 copy
    of the table (its reads and latencies); its ids must be the float32 service's."""
    from tokembed.client import EmbeddingClient

    with (
        processes.service(*server_args, "--nearest-first-pass", "int8") as server,
        EmbeddingClient(server.target, timeout_s=120) as client,
    ):
        reads, latencies, ids = _one_vector_turns(client, stored, rows)
    if not np.array_equal(ids, want):
        raise RuntimeError("this is a bug: the int8 first pass answered other ids")
    return reads, latencies


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
        "| table | head | V x D | table bytes | memory floor (in-process read) | "
        "one vector p50 | "
        f"/ floor (target <= {ONE_VECTOR_TARGET}) | {CALLERS} callers x {VECTORS_EACH} "
        "vectors/s | in-process multiply vectors/s | ratio (target >= "
        f"{CALLERS_TARGET}) | int8 first pass one vector p50 | / float32 floor (stretch <= "
        f"{INT8_TARGET}) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        int8 = "| - | - |"
        if f.int8_one_vector_p50_s is not None and f.int8_ratio is not None:
            int8 = f"| {f.int8_one_vector_p50_s * 1e3:.1f} ms | {f.int8_ratio:.2f} |"
        lines.append(
            f"| {f.dtype} | {f.head} | {f.vocab_size} x {f.d_model} | "
            f"{f.table_bytes / 2**30:.2f} GiB | "
            f"{f.floor_s * 1e3:.1f} ms | {f.one_vector_p50_s * 1e3:.1f} ms | "
            f"{f.one_vector_ratio:.2f} | {f.callers_vectors_per_s:.0f} | "
            f"{f.in_process_vectors_per_s:.0f} | {f.callers_ratio:.2f} {int8}"
        )
    return "\n".join(lines) + "\n"
