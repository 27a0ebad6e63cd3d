"""Just enough of the protobuf wire format to find where a bytes field lies in a message,
and to write the varints of an answer's known head (``decode``).

Why: with protobuf's Python runtime (upb), parsing a 32 MiB EmbedResponse copies the
payload into its arena, and every read of ``tensor.data`` copies it again into a new
``bytes``. The client instead receives the raw message
bytes from gRPC, locates ``hidden_states.data`` in them, points a numpy array at that
range (``np.frombuffer(raw, offset=...)``, no copy) and lets protobuf parse only the
small remainder. The wire format is the standard one; nothing here changes it.

Anything unusual (a field repeated where protobuf would merge, a group, a truncated
message) makes :func:`fields` raise :class:`WireError` or the caller see more than one
occurrence, and the caller falls back to a plain protobuf parse.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

WIRE_VARINT = 0
WIRE_I64 = 1
WIRE_LEN = 2
WIRE_I32 = 5


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message (for this reader)."""


class Field(NamedTuple):
    number: int
    wire_type: int
    start: int  # where the tag begins
    value_start: int  # for LEN fields, where the payload begins (after the length)
    end: int  # one past the field's last byte


def read_varint(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int]:
    """Decode the varint at ``pos``; return (value, position after it)."""
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than 10 bytes")


def write_varint(value: int) -> bytes:
    """The varint encoding of a non-negative ``value``."""
    if 0 <= value < 0x80:
        return _ONE_BYTE_VARINTS[value]
    if value < 0:
        raise ValueError(f"this is a bug: varint of negative {value}")
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_ONE_BYTE_VARINTS = [bytes([v]) for v in range(0x80)]


def fields(buf: bytes | memoryview, start: int, end: int) -> Iterator[Field]:
    """The top-level fields of the message in ``buf[start:end]``, in wire order."""
    pos = start
    while pos < end:
        tag_start = pos
        tag, pos = read_varint(buf, pos, end)
        number, wire_type = tag >> 3, tag & 7
        if number == 0:
            raise WireError("field number 0")
        if wire_type == WIRE_VARINT:
            _, after = read_varint(buf, pos, end)
            yield Field(number, wire_type, tag_start, pos, after)
            pos = after
        elif wire_type == WIRE_LEN:
            length, value_start = read_varint(buf, pos, end)
            after = value_start + length
            if after > end:
                raise WireError(f"field {number} runs past the end of its message")
            yield Field(number, wire_type, tag_start, value_start, after)
            pos = after
        elif wire_type in (WIRE_I64, WIRE_I32):
            after = pos + (8 if wire_type == WIRE_I64 else 4)
            if after > end:
                raise WireError(f"field {number} runs past the end of its message")
            yield Field(number, wire_type, tag_start, pos, after)
            pos = after
        else:
            raise WireError(f"unsupported wire type {wire_type} (field {number})")


def only(found: list[Field], number: int) -> Field | None:
    """The single LEN occurrence of ``number`` in ``found``; ``None`` if absent.

    Raises WireError when it occurs more than once or with another wire type, cases in
    which protobuf merges or overrides, which this reader leaves to protobuf.
    """
    hits = [f for f in found if f.number == number]
    if not hits:
        return None
    if len(hits) > 1 or hits[0].wire_type != WIRE_LEN:
        raise WireError(f"field {number} is repeated or not length-delimited")
    return hits[0]


def without(buf: bytes | memoryview, start: int, end: int, field: Field | None) -> bytes:
    """``buf[start:end]`` with one field cut out (tag, length and payload)."""
    view = memoryview(buf)
    if field is None:
        return bytes(view[start:end])
    return bytes(view[start : field.start]) + bytes(view[field.end : end])
