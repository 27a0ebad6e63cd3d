"""``tokembed bench --text``: text to vectors through the server against the same work in
one process.

The service (``tokembed serve``, a model exported with its own tokenizer) answers
EmbedText from 16 concurrent callers (the asyncio client on one loop), each call a batch of
64 texts of about 200 characters; the reference, in this process, does what the server's
answer is made of: the same tokenizer's batch encode of each batch, then a gather of the
ids' rows from a table of the model's size and dtype into one array. A third cell sends
the same batches through V2 system shared memory (tritonclient's asyncio client, each of
the 16 callers with regions of its own: its texts in one, the answer's ids and vectors
written into two more, the vectors copied out into an array of the caller's). Each is
measured in turns (``runner.run_interleaved``), and compared in tokens per second; the
target is a floor of 0.7 of the reference.

The tokenizer is a byte-level BPE (GPT-2's kind) trained here, on texts made here from
words of several scripts: nothing is downloaded.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokembed.bench import processes
from tokembed.bench.runner import AsyncTurns, run_interleaved, threaded_turns

CALLERS = 16
BATCH = 64
TEXT_CHARS = 200
VOCAB_SIZE = 8192
TARGET = 0.7
# fmt: off
_WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "language", "model",
    "embedding", "vector", "token", "server", "café", "naïve", "über", "señor", "привет",
    "мир", "слово", "текст", "γειά", "κόσμε", "你好", "世界", "東京", "日本語", "한국어",
    "مرحبا", "كتاب", "नमस्ते", "दुनिया", "2024", "3.14", "e=mc²", "#tag", "@user", "(ok)",
    "—", "...", "😀", "👍🏽", "🤖", "✨",
)
# fmt: on


@dataclass(frozen=True)
class TextResult:
    d_model: int
    tokens_per_request: float
    server_tokens_s: float
    reference_tokens_s: float
    server_p50_ms: float
    server_p99_ms: float
    errors: int
    shm_tokens_s: float = 0.0  # V2 through shared memory (0: not measured)
    shm_p50_ms: float = float("nan")

    @property
    def ratio(self) -> float:
        return self.server_tokens_s / self.reference_tokens_s

    @property
    def shm_ratio(self) -> float:
        return self.shm_tokens_s / self.reference_tokens_s


def texts(count: int, seed: int) -> list[str]:
    """``count`` texts of about TEXT_CHARS characters, words of several scripts."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        words: list[str] = []
        while sum(len(word) + 1 for word in words) < TEXT_CHARS:
            words.append(rng.choice(_WORDS))
        out.append(" ".join(words)[:TEXT_CHARS])
    return out


def ensure_text_model(cache_dir: Path, d_model: int) -> Path:
    """A model of VOCAB_SIZE x ``d_model`` with a BPE tokenizer trained here, exported once
    into ``cache_dir`` and reused."""
    from tokembed.export.errors import ModelDirError
    from tokembed.export.model_dir import load_model_dir

    directory = cache_dir / f"bench-text-v{VOCAB_SIZE}-d{d_model}"
    try:
        if load_model_dir(directory, verify_hashes=False).manifest.tokenizer is not None:
            return directory
    except ModelDirError:
        pass
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tokembed.export.modules import TokenEmbedding, random_table
    from tokembed.export.pipeline import ExportOptions, export_model
    from tokembed.export.tokenizer_file import attach_tokenizer, read_tokenizer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(texts(20_000, 1), trainer)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_path = cache_dir / f"bench-text-tokenizer-{VOCAB_SIZE}.json"
    tokenizer.save(str(tokenizer_path))
    table = random_table(VOCAB_SIZE, d_model, 0, None)
    module = TokenEmbedding(VOCAB_SIZE, d_model, weight=table)
    name = f"bench-text-d{d_model}"
    export_model(module, ExportOptions(out_dir=directory, name=name, force=True))
    attach_tokenizer(directory, tokenizer_path, read_tokenizer(tokenizer_path, None))
    return directory


def measure(cache_dir: Path, d_model: int, duration_s: float, env: dict[str, str]) -> TextResult:
    from tokenizers import Tokenizer

    from tokembed.client import AsyncEmbeddingClient

    directory = ensure_text_model(cache_dir, d_model)
    batches = [texts(BATCH, seed) for seed in range(100, 116)]
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    tokens = [sum(len(e.ids) for e in tokenizer.encode_batch(batch)) for batch in batches]
    table = np.random.default_rng(0).standard_normal((VOCAB_SIZE, d_model), dtype=np.float32)

    def in_process(batch: Any) -> Any:
        encodings = tokenizer.encode_batch(batch)
        ids = np.fromiter((i for e in encodings for i in e.ids), np.int64)
        return np.take(table, ids, axis=0)

    limit = str(1 << 30)
    args = ["--max-output-bytes-per-request", limit, "--max-inflight-output-bytes", limit,
            "--shared-memory", "system"]  # fmt: skip
    client: list[Any] = []
    shared = SharedMemoryCallers(f"bench-text-d{d_model}", d_model, batches)

    async def setup() -> None:
        client.append(AsyncEmbeddingClient(server.target))
        await shared.open(server.target)
        # The cell answers what EmbedText answers, or it is not measured.
        expected = await client[0].embed_text(batches[0])
        rows, ids, lengths = await shared.call(batches[0])
        if not (np.array_equal(rows, expected.hidden_states)
                and np.array_equal(ids, expected.input_ids)
                and np.array_equal(lengths, expected.lengths)):  # fmt: skip
            raise RuntimeError("the shared-memory answer differs from EmbedText's")

    async def teardown() -> None:
        await shared.close()
        await client[0].close()

    async def served(batch: Any) -> Any:
        return await client[0].embed_text(batch)

    server = processes.service(str(directory), *args, env=env)
    with server, AsyncTurns(setup, teardown) as loop:
        runs = run_interleaved(
            {
                "server": loop.turns(served, batches, concurrency=CALLERS),
                "shared memory": loop.turns(shared.call, batches, concurrency=CALLERS),
                "reference": threaded_turns(in_process, batches),
            },
            duration_s=duration_s, max_requests=1 << 30, rounds=4,
        )  # fmt: skip
    per_request = float(np.mean(tokens))
    server_run, reference_run = runs["server"], runs["reference"]
    shm_run = runs["shared memory"]
    return TextResult(
        d_model, per_request, server_run.rps * per_request, reference_run.rps * per_request,
        server_run.percentile_ms(50), server_run.percentile_ms(99),
        server_run.errors + shm_run.errors, shm_run.rps * per_request, shm_run.percentile_ms(50),
    )  # fmt: skip


class SharedMemoryCallers:
    """Text to vectors through V2 system shared memory, with tritonclient's asyncio client:
    each of ``CALLERS`` callers has regions of its own (a call takes a free set, and gives
    it back once its answer is copied out): its texts, serialised as tritonclient
    serialises a BYTES tensor; the answer's ``input_ids`` and ``hidden_states``, written
    there by the server, sized for the most a batch may answer (a token covers at least
    a byte of its text, bar two special tokens: the server's own bound); ``lengths`` come
    in the response."""

    def __init__(self, model: str, d_model: int, batches: list[list[str]]) -> None:
        self._model = model
        self._d_model = d_model
        most_bytes = max(sum(len(text.encode()) for text in batch) for batch in batches)
        self._most_tokens = most_bytes + 2 * BATCH
        self._text_bytes = most_bytes + 4 * BATCH
        self._tag = f"tokembed_bench_text_{os.getpid()}_{secrets.token_hex(4)}"
        self._client: Any = None
        self._handles: list[tuple[str, Any]] = []
        self._free: asyncio.Queue[dict[str, tuple[str, Any, int]]] | None = None

    async def open(self, target: str) -> None:
        import tritonclient.grpc.aio as triton
        import tritonclient.utils.shared_memory as shm

        self._client = triton.InferenceServerClient(target)
        self._free = asyncio.Queue()  # on the loop that uses it
        sizes = {"text": self._text_bytes, "ids": self._most_tokens * 8,
                 "rows": self._most_tokens * self._d_model * 4}  # fmt: skip
        for caller in range(CALLERS):
            regions = {}
            for part, size in sizes.items():
                name = f"{self._tag}_{caller}_{part}"
                handle = shm.create_shared_memory_region(name, f"/{name}", size)
                self._handles.append((name, handle))
                await self._client.register_system_shared_memory(name, f"/{name}", size)
                regions[part] = (name, handle, size)
            self._free.put_nowait(regions)

    async def close(self) -> None:
        import tritonclient.utils.shared_memory as shm

        if self._client is None:
            return
        for name, handle in self._handles:
            await self._client.unregister_system_shared_memory(name)
            shm.destroy_shared_memory_region(handle)
        self._handles.clear()
        await self._client.close()

    async def call(self, batch: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        import tritonclient.grpc.aio as triton
        import tritonclient.utils.shared_memory as shm
        from tritonclient.utils import serialize_byte_tensor, serialized_byte_size

        assert self._free is not None, "SharedMemoryCallers.call before open"
        regions = await self._free.get()
        try:
            text_name, text_region, _ = regions["text"]
            ids_name, ids_region, ids_size = regions["ids"]
            rows_name, rows_region, rows_size = regions["rows"]
            serialized = serialize_byte_tensor(
                np.array([text.encode() for text in batch], dtype=np.object_)
            )
            shm.set_shared_memory_region(text_region, [serialized])
            given = triton.InferInput("text", [len(batch)], "BYTES")
            given.set_shared_memory(text_name, serialized_byte_size(serialized))
            ids_out = triton.InferRequestedOutput("input_ids")
            ids_out.set_shared_memory(ids_name, ids_size)
            rows_out = triton.InferRequestedOutput("hidden_states")
            rows_out.set_shared_memory(rows_name, rows_size)
            result = await self._client.infer(
                self._model, [given],
                outputs=[ids_out, triton.InferRequestedOutput("lengths"), rows_out],
            )  # fmt: skip
            count = int(result.get_output("hidden_states").shape[0])
            # Copied out: the region is the next call's once given back.
            rows = np.array(
                shm.get_contents_as_numpy(rows_region, np.float32, [count, self._d_model])
            )
            ids = np.array(shm.get_contents_as_numpy(ids_region, np.int64, [count]))
            return rows, ids, result.as_numpy("lengths")
        finally:
            self._free.put_nowait(regions)


def markdown(results: list[TextResult], command: str) -> str:
    lines = [
        "# Text to vectors (EmbedText)",
        "",
        f"`{command}`",
        "",
        f"{CALLERS} concurrent callers, batches of {BATCH} texts of ~{TEXT_CHARS} characters; "
        "the reference is the same tokenizer's batch encode and a gather of the same table "
        f"in one process. Target: server >= {TARGET} x reference tokens/s. gRPC: EmbedText "
        "(tokembed.v1's asyncio client); shared memory: V2 ModelInfer, the texts, ids and "
        "vectors in each caller's own regions.",
        "",
        "| D | tokens/request | reference tokens/s | gRPC tokens/s | gRPC ratio | gRPC p50 ms "
        "| gRPC p99 ms | shm tokens/s | shm ratio | shm p50 ms | errors | verdict (gRPC, shm) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        verdicts = ", ".join("met" if ratio >= TARGET else "NOT met"
                             for ratio in (r.ratio, r.shm_ratio))  # fmt: skip
        lines.append(
            f"| {r.d_model} | {r.tokens_per_request:.0f} | {r.reference_tokens_s:,.0f} | "
            f"{r.server_tokens_s:,.0f} | {r.ratio:.2f} | {r.server_p50_ms:.1f} | "
            f"{r.server_p99_ms:.1f} | {r.shm_tokens_s:,.0f} | {r.shm_ratio:.2f} | "
            f"{r.shm_p50_ms:.1f} | {r.errors} | {verdicts} |"
        )
    return "\n".join(lines) + "\n"
