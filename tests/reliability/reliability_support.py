"""Helpers for the reliability tests: raw answers decoded, good requests with their exact
answers, process memory.

Requests travel as raw bytes on the method paths (``channel.unary_unary(path)`` with no
serializer, ``support.requests.encode``), so a test can send anything at all, including
bytes that are not protobuf.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokembed.server.edge import wire
from tokembed.v1 import embedding_pb2 as pb

from support.fixtures import SMALL_PAD
from support.models import padded
from support.requests import encode

SERVICE = "/tokembed.v1.EmbeddingService/"
EMBED = SERVICE + "Embed"
EMBED_CHUNKED = SERVICE + "EmbedChunked"
EMBED_STREAM = SERVICE + "EmbedStream"
MiB = 1024 * 1024


def channel_options(max_message_bytes: int = 256 * MiB) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def decode_response(raw: bytes) -> np.ndarray:
    reply = pb.EmbedResponse.FromString(raw)
    return tensor_array(reply.hidden_states)


def tensor_array(tensor: pb.Tensor) -> np.ndarray:
    dtype = {pb.DTYPE_FLOAT32: "<f4", pb.DTYPE_FLOAT16: "<f2"}[tensor.dtype]
    return np.frombuffer(tensor.data, dtype=dtype).reshape(list(tensor.shape))


# --- good requests with their exact answers (the small model: V=1000, D=64, padding 0)


@dataclass(frozen=True)
class GoodCase:
    raw: bytes
    want: np.ndarray


def good_case(rng: random.Random, rows: np.ndarray, *, max_tokens: int = 256) -> GoodCase:
    """A random valid request of the small model (rectangular or ragged, int64 or int32,
    float32 or float16, sometimes with unknown fields) and the exact array the server must
    answer; ``rows``: the small model's (the ``small_rows`` fixture)."""
    vocab = rows.shape[0]
    half = rng.random() < 0.3
    out_dtype = pb.DTYPE_FLOAT16 if half else rng.choice([pb.DTYPE_UNSPECIFIED, pb.DTYPE_FLOAT32])
    id_dtype, np_dtype = rng.choice([(pb.DTYPE_INT64, "<i8"), (pb.DTYPE_INT32, "<i4")])
    np_rng = np.random.default_rng(rng.getrandbits(32))
    if rng.random() < 0.6:
        batch = rng.randint(1, 8)
        seq = rng.randint(1, max(1, max_tokens // batch))
        ids = np_rng.integers(0, vocab, size=(batch, seq)).astype(np_dtype)
        raw = encode(
            ids,
            ids_dtype=id_dtype,
            output_dtype=out_dtype,
            model_name=rng.choice(["", "small"]),
            request_id=f"good-{rng.random()}",
        )
        want = rows[ids.astype(np.int64)]
    else:
        lengths = [rng.randint(1, max(1, max_tokens // 8)) for _ in range(rng.randint(1, 8))]
        flat_ids = np_rng.integers(0, vocab, size=sum(lengths)).astype(np_dtype)
        layout = rng.choice(
            [pb.RAGGED_LAYOUT_UNSPECIFIED, pb.RAGGED_LAYOUT_PADDED, pb.RAGGED_LAYOUT_FLAT]
        )
        raw = encode(
            flat_ids, ids_dtype=id_dtype, lengths=lengths, output_dtype=out_dtype, layout=layout
        )
        flat = rows[flat_ids.astype(np.int64)]
        if layout == pb.RAGGED_LAYOUT_FLAT:
            want = flat
        else:  # padded positions hold the padding id's row
            offsets = np.cumsum([0, *lengths])
            seqs = [
                flat_ids[offsets[i] : offsets[i + 1]].astype(np.int64) for i in range(len(lengths))
            ]
            want = padded(rows, seqs, rows[SMALL_PAD])
    if rng.random() < 0.2:
        raw += unknown_field(rng)  # unknown fields are skipped by every protobuf parser
    return GoodCase(raw, want.astype(np.float16) if half else want)


def unknown_field(rng: random.Random) -> bytes:
    number = rng.randint(7, 5000)
    if rng.random() < 0.5:
        return varint(number << 3 | 0) + varint(rng.getrandbits(63))
    payload = rng.randbytes(rng.randint(0, 64))
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def varint(value: int) -> bytes:
    """Protobuf's varint of ``value``; negative values as their 64-bit two's complement."""
    return wire.varint(value & ((1 << 64) - 1))


# --- the server process's memory, from /proc


def proc_status_bytes(pid: int, field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak resident) of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == field:
            return int(value.split()[0]) * 1024
    raise AssertionError(f"/proc/{pid}/status has no {field}")


def rss(pid: int) -> int:
    return proc_status_bytes(pid, "VmRSS")


def peak_rss(pid: int) -> int:
    return proc_status_bytes(pid, "VmHWM")


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else float("nan")


class Deadline:
    """A wall-clock budget for a loop: ``while budget: ...``."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def __bool__(self) -> bool:
        return time.monotonic() < self.end

    @property
    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


def describe(values: Sequence[float]) -> str:
    if not values:
        return "n=0"
    return (
        f"n={len(values)} p50={percentile(values, 50) * 1000:.1f}ms "
        f"p99={percentile(values, 99) * 1000:.1f}ms max={max(values) * 1000:.1f}ms"
    )
