"""Protobuf's wire format, the pieces the front ends write their answers with by hand
(``edge.v1.responses``, ``edge.v2.responses``): a varint, a field's key, a string field.
The bytes are those protobuf writes (tests/server/test_responses.py compares them)."""

from __future__ import annotations

LEN = 2  # protobuf wire types: length-delimited, varint, 64-bit
VARINT = 0
I64 = 1


def varint(value: int) -> bytes:
    if value < 0:
        raise ValueError(f"this is a bug: varint of negative {value}")
    if value < _SMALL_VARINTS_LIMIT:
        return _SMALL_VARINTS[value]
    return _encode_varint(value)


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


# Shapes, tags and small lengths are almost always below 2**14: look them up, don't build
# them (a response has about a dozen varints; building one in Python costs more than a
# look-up).
_SMALL_VARINTS_LIMIT = 1 << 14
_SMALL_VARINTS = tuple(_encode_varint(value) for value in range(_SMALL_VARINTS_LIMIT))


def field_key(field_number: int, wire_type: int) -> bytes:
    return varint(field_number << 3 | wire_type)


def string_field(key: bytes, value: str) -> bytes:
    """A string field: left out when empty, as protobuf writes a proto3 string."""
    if not value:
        return b""
    encoded = value.encode("utf-8")
    return key + varint(len(encoded)) + encoded
