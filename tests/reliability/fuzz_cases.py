"""A seeded generator of bad requests, one defect each, with the status each must get.

Every case is wire bytes for the raw method path, so it can be anything: bytes that are
not protobuf at all, or a well-formed ``EmbedRequest`` with exactly one thing wrong.
One defect per case makes the expected status code exact, not just "not OK".
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
from reliability_support import encode, unknown_field, varint

from tokembed.v1 import embedding_pb2 as pb

from support.fixtures import SMALL_V

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED

# The fuzzed server's limits (see test_fuzz.py): 4096 tokens, 256 KiB of output a request.
MAX_TOKENS = 4096
MAX_OUTPUT_BYTES = 256 * 1024
FLOAT32_TOKEN_LIMIT = MAX_OUTPUT_BYTES // (64 * 4)  # D=64: 1024 float32 tokens

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
HUGE_DIMS = [2**31, 2**32 + 1, 2**40, 2**53 + 1, 2**62, INT64_MAX]


@dataclass(frozen=True)
class BadCase:
    category: str
    raw: bytes
    code: grpc.StatusCode
    reason: str  # the tokembed-error-reason the server must send with it


def _ids(rng: random.Random, tokens: int | None = None) -> np.ndarray:
    """Valid rectangular ids, int64, [B, S]."""
    if tokens is None:
        batch, seq = rng.randint(1, 4), rng.randint(1, 16)
    else:
        batch, seq = 1, tokens
    np_rng = np.random.default_rng(rng.getrandbits(32))
    return np_rng.integers(0, SMALL_V, size=(batch, seq), dtype=np.int64)


def _ragged(rng: random.Random) -> tuple[np.ndarray, list[int]]:
    lengths = [rng.randint(1, 8) for _ in range(rng.randint(1, 5))]
    np_rng = np.random.default_rng(rng.getrandbits(32))
    return np_rng.integers(0, SMALL_V, size=sum(lengths), dtype=np.int64), lengths


def _maybe_unknown(rng: random.Random, raw: bytes) -> bytes:
    return raw + unknown_field(rng) if rng.random() < 0.2 else raw


# --- 1. malformed protobuf bytes


def _corrupt_suffix(rng: random.Random) -> bytes:
    field = rng.randint(1, 15)
    choice = rng.randrange(10)
    if choice == 0:  # wire types 6 and 7 do not exist
        return bytes([field << 3 | rng.choice([6, 7])]) + rng.randbytes(rng.randint(0, 4))
    if choice == 1:  # field number 0 is invalid
        return bytes([rng.choice([0, 2])]) + rng.randbytes(rng.randint(1, 4))
    if choice == 2:  # a length that runs past the end
        body = rng.randbytes(rng.randint(0, 16))
        return bytes([field << 3 | 2]) + varint(len(body) + rng.randint(1, 2**20)) + body
    if choice == 3:  # a varint cut short
        return bytes([field << 3]) + b"\xff" * rng.randint(1, 9)
    if choice == 4:  # a varint of more than 10 bytes
        return bytes([field << 3]) + b"\xff" * rng.randint(10, 20) + b"\x01"
    if choice == 5:  # a string field (model_name, request_id) that is not UTF-8
        junk = rng.choice(
            [b"\xc3\x28", b"\xed\xa0\x80", b"\xff\xfe", b"a\x80b", b"\xf8\x88\x80\x80"]
        )
        return bytes([rng.choice([5, 6]) << 3 | 2]) + varint(len(junk)) + junk
    if choice == 6:  # a group opened and never closed, or closed and never opened
        return bytes([field << 3 | rng.choice([3, 4])])
    if choice == 7:  # the same faults inside the Tensor message
        inner = bytes([rng.randint(1, 3) << 3 | 2]) + varint(100 + rng.randint(0, 99)) + b"abc"
        return b"\x0a" + varint(len(inner)) + inner
    if choice == 8:  # packed lengths that run past the end
        return b"\x12" + varint(rng.randint(10, 1000)) + rng.randbytes(rng.randint(0, 9))
    return bytes([field << 3 | 3, (field % 15 + 1) << 3 | 4])  # a group closed by another


def _parses(raw: bytes) -> bool:
    try:
        pb.EmbedRequest.FromString(raw)
    except Exception:
        return False
    return True


def malformed(rng: random.Random) -> BadCase:
    if rng.random() < 0.3:  # random bytes, kept only when they are not a message
        for _ in range(100):
            raw = rng.randbytes(rng.randint(1, 256))
            if not _parses(raw):
                break
    else:
        prefix = encode(_ids(rng)) if rng.random() < 0.7 else b""
        raw = prefix + _corrupt_suffix(rng)
    if _parses(raw):
        raise AssertionError(f"the generator made parseable bytes: {raw!r}")
    return BadCase("malformed", raw, INVALID, "invalid_input")


# --- 2. wrong dtypes


def wrong_dtype(rng: random.Random) -> BadCase:
    ids = _ids(rng)
    if rng.random() < 0.6:
        dtype = rng.choice([pb.DTYPE_UNSPECIFIED, pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16])
        data = {
            pb.DTYPE_UNSPECIFIED: ids.tobytes(),
            pb.DTYPE_FLOAT32: ids.astype("<f4").tobytes(),
            pb.DTYPE_FLOAT16: ids.astype("<f2").tobytes(),
        }[dtype]
        raw = encode(ids, dtype=dtype, data=data)
    else:  # an output dtype that is an integer type
        raw = encode(ids, output_dtype=rng.choice([pb.DTYPE_INT64, pb.DTYPE_INT32]))
    return BadCase("wrong_dtype", _maybe_unknown(rng, raw), INVALID, "invalid_input")


# --- 3. shapes and lengths that disagree


def disagreeing_shape(rng: random.Random) -> BadCase:
    ids = _ids(rng)
    batch, seq = ids.shape
    choice = rng.randrange(7)
    if choice == 0:  # data a few bytes long or short
        data = ids.tobytes()
        delta = rng.randint(1, 15)
        data = data + rng.randbytes(delta) if rng.random() < 0.5 else data[:-delta]
        raw = encode(ids, data=data)
    elif choice == 1:  # a shape whose product is not the number of ids
        shape = [batch, seq + rng.randint(1, 5)] if rng.random() < 0.5 else [batch + 1, seq]
        raw = encode(ids, shape=shape)
    elif choice == 2:  # int32 data declared int64 (half the bytes), or the reverse
        if rng.random() < 0.5:
            raw = encode(ids, dtype=pb.DTYPE_INT64, data=ids.astype("<i4").tobytes())
        else:
            raw = encode(ids, dtype=pb.DTYPE_INT32, data=ids.tobytes())
    elif choice == 3:  # not [B, S] and no lengths
        shape = rng.choice([[ids.size], [1, batch, seq], [batch, seq, 1]])
        raw = encode(ids, shape=shape)
    elif choice == 4:  # lengths with a 2-D shape
        raw = encode(ids, lengths=[seq] * batch)
    elif choice == 5:  # lengths that do not sum to the number of ids
        flat, lengths = _ragged(rng)
        lengths[rng.randrange(len(lengths))] += rng.choice([-1, 1, 7])
        if any(length <= 0 for length in lengths):
            lengths = [length if length > 0 else 2 for length in lengths]
        if sum(lengths) == flat.size:
            lengths.append(1)
        raw = encode(flat, lengths=lengths)
    else:  # a length of zero or less
        flat, lengths = _ragged(rng)
        lengths[rng.randrange(len(lengths))] = rng.choice([0, -1, -5, INT64_MIN])
        raw = encode(flat, lengths=lengths)
    return BadCase("disagreeing_shape", _maybe_unknown(rng, raw), INVALID, "invalid_input")


# --- 4. huge declared shapes with tiny data


def huge_shape(rng: random.Random) -> BadCase:
    data = _ids(rng, tokens=rng.randint(1, 4)).tobytes()
    choice = rng.randrange(4)
    if choice == 0:
        shape = [rng.choice(HUGE_DIMS), rng.choice(HUGE_DIMS)]
        raw = encode(dtype=pb.DTYPE_INT64, shape=shape, data=data)
    elif choice == 1:
        shape = rng.choice([[1, rng.choice(HUGE_DIMS)], [rng.choice(HUGE_DIMS), 1]])
        raw = encode(dtype=rng.choice([pb.DTYPE_INT64, pb.DTYPE_INT32]), shape=shape, data=data)
    elif choice == 2:  # negative dimensions
        shape = [rng.choice([-1, -(2**31), INT64_MIN]), rng.randint(1, 4)]
        rng.shuffle(shape)
        raw = encode(dtype=pb.DTYPE_INT64, shape=shape, data=data)
    else:  # ragged: lengths that agree with a huge shape, but 1-4 ids of data
        half = rng.choice(HUGE_DIMS[:-1]) // 2
        raw = encode(dtype=pb.DTYPE_INT64, shape=[2 * half], lengths=[half, half], data=data)
    return BadCase("huge_shape", _maybe_unknown(rng, raw), INVALID, "invalid_input")


# --- 5. negative and out-of-range ids


def bad_ids(rng: random.Random) -> BadCase:
    int32 = rng.random() < 0.4
    low, high = (INT32_MIN, INT32_MAX) if int32 else (INT64_MIN, INT64_MAX)
    outside = [
        -1,
        -rng.randint(2, 10**6),
        low,
        SMALL_V,
        SMALL_V + 1,
        SMALL_V + rng.randint(2, 10**6),
        high,
    ]
    ragged = rng.random() < 0.3
    if ragged:
        flat, lengths = _ragged(rng)
        ids = flat.copy()
    else:
        ids, lengths = _ids(rng), []
    flat_view = ids.reshape(-1)
    for _ in range(rng.randint(1, 3)):
        flat_view[rng.randrange(flat_view.size)] = rng.choice(outside)
    dtype = pb.DTYPE_INT32 if int32 else pb.DTYPE_INT64
    raw = encode(ids.astype("<i4" if int32 else "<i8"), dtype=dtype, lengths=lengths)
    return BadCase("bad_ids", _maybe_unknown(rng, raw), INVALID, "invalid_input")


# --- 6. empty tensors


def empty(rng: random.Random) -> BadCase:
    choice = rng.randrange(5)
    if choice == 0:
        shape = rng.choice([[0, rng.randint(1, 9)], [rng.randint(1, 9), 0], [0, 0]])
        raw = encode(dtype=pb.DTYPE_INT64, shape=shape, data=b"")
    elif choice == 1:  # a tensor with no shape and no data
        raw = encode(dtype=rng.choice([pb.DTYPE_INT64, pb.DTYPE_INT32]), shape=[], data=b"")
    elif choice == 2:  # no tensor at all
        raw = encode(output_dtype=rng.choice([pb.DTYPE_UNSPECIFIED, pb.DTYPE_FLOAT16]))
    elif choice == 3:  # the empty message
        raw = b""
    else:  # ragged with nothing in it
        raw = encode(dtype=pb.DTYPE_INT64, shape=[0], data=b"", lengths=[0])
    return BadCase("empty", _maybe_unknown(rng, raw), INVALID, "invalid_input")


# --- 7. invalid enum values (proto3 enums are open: any int32 arrives)


def _bad_enum(rng: random.Random, valid: range) -> int:
    while True:
        value = rng.choice(
            [
                rng.randint(INT32_MIN, -1),
                rng.randint(valid.stop, INT32_MAX),
                rng.randint(valid.stop, valid.stop + 10),
            ]
        )
        if value not in valid:
            return value


# Each enum's values, as the proto defines them today (values past them are unknown).
_DTYPES = range(0, max(pb.DType.values()) + 1)
_RAGGED_LAYOUTS = range(0, max(pb.RaggedLayout.values()) + 1)
_LAYOUTS = range(0, max(pb.Layout.values()) + 1)


def bad_enum(rng: random.Random) -> BadCase:
    choice = rng.randrange(4)
    if choice == 0:
        ids = _ids(rng)
        raw = encode(ids, dtype=_bad_enum(rng, _DTYPES))
    elif choice == 1:
        raw = encode(_ids(rng), output_dtype=_bad_enum(rng, _DTYPES))
    elif choice == 2:  # the ragged layout is only read for ragged input
        flat, lengths = _ragged(rng)
        raw = encode(flat, lengths=lengths, layout=_bad_enum(rng, _RAGGED_LAYOUTS))
    else:
        raw = encode(_ids(rng), order=_bad_enum(rng, _LAYOUTS))
    return BadCase("bad_enum", _maybe_unknown(rng, raw), INVALID, "invalid_input")


# --- 8. unknown model names


def unknown_model(rng: random.Random) -> BadCase:
    alphabet = string.ascii_letters + string.digits + "-_./ :" + "éü漢字🙂\u200b"
    while True:
        name = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 64)))
        if rng.random() < 0.05:
            name *= 64  # a few KB
        if name != "small":
            break
    raw = encode(_ids(rng), model_name=name)
    return BadCase("unknown_model", _maybe_unknown(rng, raw), NOT_FOUND, "not_found")


# --- and requests over the per-request limits


def too_large(rng: random.Random) -> BadCase:
    if rng.random() < 0.5:  # within the token limit, over the output bytes in float32
        ids = _ids(rng, tokens=rng.randint(FLOAT32_TOKEN_LIMIT + 1, MAX_TOKENS))
    else:
        ids = _ids(rng, tokens=rng.randint(MAX_TOKENS + 1, MAX_TOKENS + 2000))
    return BadCase("too_large", encode(ids), EXHAUSTED, "too_large")


CATEGORIES: dict[str, Callable[[random.Random], BadCase]] = {
    "malformed": malformed,
    "wrong_dtype": wrong_dtype,
    "disagreeing_shape": disagreeing_shape,
    "huge_shape": huge_shape,
    "bad_ids": bad_ids,
    "empty": empty,
    "bad_enum": bad_enum,
    "unknown_model": unknown_model,
    "too_large": too_large,
}


def bad_cases(seed: int, count: int) -> list[BadCase]:
    """``count`` cases, the categories in turn, so each gets count / 9 of them."""
    rng = random.Random(seed)
    makers = list(CATEGORIES.values())
    return [makers[index % len(makers)](rng) for index in range(count)]
