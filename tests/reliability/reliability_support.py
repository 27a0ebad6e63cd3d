"""Helpers for the reliability tests: raw requests, exact expected answers, process memory.

Requests travel as raw bytes on the method paths (``channel.unary_unary(path)`` with no
serializer), so a test can send anything at all, including bytes that are not protobuf.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from tokembed.server.edge.v1 import responses
from tokembed.v1 import embedding_pb2 as pb

from support.fixtures import SMALL_D, SMALL_PAD, SMALL_SEED, SMALL_V
from support.models import reference_rows

SERVICE = "/tokembed.v1.EmbeddingService/"
EMBED = SERVICE + "Embed"
EMBED_CHUNKED = SERVICE + "EmbedChunked"
EMBED_STREAM = SERVICE + "EmbedStream"
MiB = 1024 * 1024
REASON_KEY = "tokembed-error-reason"


def channel_options(max_message_bytes: int = 256 * MiB) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def encode(
    ids: np.ndarray | None = None,
    *,
    dtype: int = pb.DTYPE_INT64,
    shape: Sequence[int] | None = None,
    data: bytes | None = None,
    lengths: Sequence[int] = (),
    output_dtype: int = pb.DTYPE_UNSPECIFIED,
    layout: int = pb.RAGGED_LAYOUT_UNSPECIFIED,
    model_name: str = "",
    request_id: str = "",
    order: int = pb.LAYOUT_UNSPECIFIED,
) -> bytes:
    """An ``EmbedRequest`` as wire bytes; any field may be given a value that is wrong
    (``layout``: the ragged layout; ``order``: the Layout field, batch- or sequence-first)."""
    request = pb.EmbedRequest(
        lengths=list(lengths),
        output_dtype=output_dtype,  # type: ignore[arg-type]
        ragged_layout=layout,  # type: ignore[arg-type]
        model_name=model_name,
        request_id=request_id,
        layout=order,  # type: ignore[arg-type]
    )
    if ids is not None or data is not None or shape is not None:
        request.input_ids.dtype = dtype  # type: ignore[assignment]
        request.input_ids.shape.extend(list(ids.shape if shape is None else shape))  # type: ignore[union-attr]
        request.input_ids.data = ids.tobytes() if data is None else data  # type: ignore[union-attr]
    return request.SerializeToString()


def decode_response(raw: bytes) -> np.ndarray:
    reply = pb.EmbedResponse.FromString(raw)
    return tensor_array(reply.hidden_states)


def tensor_array(tensor: pb.Tensor) -> np.ndarray:
    dtype = {pb.DTYPE_FLOAT32: "<f4", pb.DTYPE_FLOAT16: "<f2"}[tensor.dtype]
    return np.frombuffer(tensor.data, dtype=dtype).reshape(list(tensor.shape))


def reason_of(error: grpc.aio.AioRpcError | grpc.RpcError) -> str | None:
    for key, value in error.trailing_metadata() or ():  # type: ignore[union-attr]
        if key == REASON_KEY:
            return str(value)
    return None


# --- good requests with their exact answers (the small model: V=1000, D=64, padding 0)

SMALL_ROWS = reference_rows(SMALL_V, SMALL_D, SMALL_SEED, SMALL_PAD)


@dataclass(frozen=True)
class GoodCase:
    raw: bytes
    want: np.ndarray


def good_case(
    rng: random.Random, *, max_tokens: int = 256, rows: np.ndarray = SMALL_ROWS
) -> GoodCase:
    """A random valid request (rectangular or ragged, int64 or int32, float32 or float16,
    sometimes with unknown fields) and the exact array the server must answer."""
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
            dtype=id_dtype,
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
            flat_ids, dtype=id_dtype, lengths=lengths, output_dtype=out_dtype, layout=layout
        )
        flat = rows[flat_ids.astype(np.int64)]
        if layout == pb.RAGGED_LAYOUT_FLAT:
            want = flat
        else:  # padded positions hold the padding id's row
            want = np.broadcast_to(rows[SMALL_PAD], (len(lengths), max(lengths), rows.shape[1]))
            want = want.copy()
            offset = 0
            for index, length in enumerate(lengths):
                want[index, :length] = flat[offset : offset + length]
                offset += length
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
    return responses.varint(value & ((1 << 64) - 1))


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
