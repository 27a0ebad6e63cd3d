"""``tokembed bench --text``: text to vectors through the server against the same work in
one process.

The service (``tokembed serve``, a model exported with its own tokenizer) answers
EmbedText from 16 concurrent callers (the asyncio client on one loop), each call a batch of
64 texts of about 200 characters; the reference, in this process, does what the server's
answer is made of: the same tokenizer's batch encode of each batch, then a gather of the
ids' rows from a table of the model's size and dtype into one array. Each is measured in
turns (``runner.run_interleaved``), and compared in tokens per second; the target is a
floor of 0.7 of the reference.

The tokenizer is a byte-level BPE (GPT-2's kind) trained here, on texts made here from
words of several scripts: nothing is downloaded.
"""

from __future__ import annotations

import random
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

    @property
    def ratio(self) -> float:
        return self.server_tokens_s / self.reference_tokens_s


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
    args = ["--max-output-bytes-per-request", limit, "--max-inflight-output-bytes", limit]
    client: list[Any] = []

    async def setup() -> None:
        client.append(AsyncEmbeddingClient(server.target))

    async def teardown() -> None:
        await client[0].close()

    async def served(batch: Any) -> Any:
        return await client[0].embed_text(batch)

    server = processes.service(str(directory), *args, env=env)
    with server, AsyncTurns(setup, teardown) as loop:
        runs = run_interleaved(
            {
                "server": loop.turns(served, batches, concurrency=CALLERS),
                "reference": threaded_turns(in_process, batches),
            },
            duration_s=duration_s, max_requests=1 << 30, rounds=4,
        )  # fmt: skip
    per_request = float(np.mean(tokens))
    server_run, reference_run = runs["server"], runs["reference"]
    return TextResult(
        d_model, per_request, server_run.rps * per_request, reference_run.rps * per_request,
        server_run.percentile_ms(50), server_run.percentile_ms(99), server_run.errors,
    )  # fmt: skip


def markdown(results: list[TextResult], command: str) -> str:
    lines = [
        "# Text to vectors (EmbedText)",
        "",
        f"`{command}`",
        "",
        f"{CALLERS} concurrent callers, batches of {BATCH} texts of ~{TEXT_CHARS} characters; "
        "the reference is the same tokenizer's batch encode and a gather of the same table "
        f"in one process. Target: server >= {TARGET} x reference tokens/s.",
        "",
        "| D | tokens/request | server tokens/s | reference tokens/s | ratio | p50 ms | p99 ms "
        "| errors | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        verdict = "met" if r.ratio >= TARGET else "NOT met"
        lines.append(
            f"| {r.d_model} | {r.tokens_per_request:.0f} | {r.server_tokens_s:,.0f} | "
            f"{r.reference_tokens_s:,.0f} | {r.ratio:.2f} | {r.server_p50_ms:.1f} | "
            f"{r.server_p99_ms:.1f} | {r.errors} | {verdict} |"
        )
    return "\n".join(lines) + "\n"
