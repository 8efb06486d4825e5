"""Records read from a store: a bounded JSON parse and typed access to their fields.

Whoever can write a store can write any bytes under any key, so a record read back is input, not
data we wrote: ``parse_record`` refuses a value over ``MAX_RECORD_BYTES`` or nested deeper than
``MAX_RECORD_DEPTH`` before the JSON parser sees it (a deep document would otherwise end the
reader with ``RecursionError``), and raises ``RecordError`` (a ``ValueError``) naming the record.
A record longer than ``PACK_ABOVE`` bytes is stored zlib-compressed (``pack_record``; the round
record of a thousand nodes and more: every node reads it, so the server sends it once per node
per round); ``parse_record`` reads both forms, decompressing at most ``MAX_RECORD_BYTES``.
The ``*_field`` helpers read one field of a parsed object with its expected type and fall back to
a default when it is missing or of another type, so a mistyped field never reaches arithmetic or
string formatting.
"""

from __future__ import annotations

import json
import re
import zlib
from typing import Any

__all__ = ["MAX_RECORD_BYTES", "MAX_RECORD_DEPTH", "PACK_ABOVE", "RecordError", "int_field",
           "number_field", "pack_record", "parse_json", "parse_record", "str_field"]

MAX_RECORD_BYTES = 8 * 1024 * 1024  # the native server's largest value (kMaxValueBytes)
MAX_RECORD_DEPTH = 16  # the deepest record we write nests 2 levels
# Longer records are stored compressed: a round record of about 1,000 nodes (node ids
# "addr-pid-local", 25-30 bytes each); smaller ones stay plain JSON, readable with any tool.
PACK_ABOVE = 32 * 1024
_PACKED = b"\x00z1"  # a compressed record's first bytes (JSON text never starts with NUL)

# A JSON string (skipped whole, so brackets inside it do not count) or one bracket.
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_OPEN = frozenset(b"[{")


class RecordError(ValueError):
    """A record read from a store is too large, too deep or not JSON."""


def _depth(data: bytes) -> int:
    depth = deepest = 0
    for match in _TOKENS.finditer(data):
        token = match.group()
        if len(token) != 1:
            continue  # a string
        if token[0] in _OPEN:
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_RECORD_DEPTH:
                    break
        else:
            depth -= 1
    return deepest


def pack_record(raw: bytes) -> bytes:
    """A record's JSON ``raw`` as stored: itself up to ``PACK_ABOVE`` bytes, else compressed
    (zlib, behind a prefix that no JSON text has)."""
    return raw if len(raw) <= PACK_ABOVE else _PACKED + zlib.compress(raw)


def _unpack(raw: bytes, what: str) -> bytes:
    """A compressed record's JSON, never more than ``MAX_RECORD_BYTES`` of it (a small record
    may claim to expand to any size)."""
    unpacker = zlib.decompressobj()
    try:
        out = unpacker.decompress(raw[len(_PACKED):], MAX_RECORD_BYTES + 1)
    except zlib.error as exc:
        raise RecordError(f"{what}: not a valid compressed record ({exc})") from None
    if len(out) > MAX_RECORD_BYTES:
        raise RecordError(f"{what}: more than the {MAX_RECORD_BYTES} bytes a record may have, "
                          "once decompressed")
    if not unpacker.eof or unpacker.unused_data:
        raise RecordError(f"{what}: a compressed record cut short or followed by other bytes")
    return out


def parse_record(data: bytes | str, what: str) -> Any:
    """``data``'s JSON value (``data`` plain or as ``pack_record`` stores it); ``RecordError``
    naming ``what`` when it is over ``MAX_RECORD_BYTES`` (compressed or not), nested deeper than
    ``MAX_RECORD_DEPTH`` or not JSON."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > MAX_RECORD_BYTES:
        raise RecordError(f"{what}: {len(raw)} bytes, more than the {MAX_RECORD_BYTES} a record "
                          "may have")
    if raw.startswith(_PACKED):
        raw = _unpack(raw, what)
    if raw.count(b"[") + raw.count(b"{") > MAX_RECORD_DEPTH and _depth(raw) > MAX_RECORD_DEPTH:
        raise RecordError(f"{what}: nested deeper than {MAX_RECORD_DEPTH} levels")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise RecordError(f"{what}: not JSON ({exc}): {raw[:80]!r}") from None


def parse_json(data: bytes | None) -> Any:
    """A record's JSON value; None when absent or not a valid record (see ``parse_record``)."""
    if data is None:
        return None
    try:
        return parse_record(data, "record")
    except RecordError:
        return None


def str_field(obj: Any, key: str, default: str | None = None) -> str | None:
    """``obj[key]`` when ``obj`` is a dict and the value a string, else ``default``."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, str) else default


def int_field(obj: Any, key: str, default: int | None = None) -> int | None:
    """``obj[key]`` when ``obj`` is a dict and the value an int (not a bool), else ``default``."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def number_field(obj: Any, key: str, default: float | None = None) -> float | None:
    """``obj[key]`` as a float when it is a finite int or float (not a bool), else ``default``."""
    value = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    try:
        value = float(value)
    except OverflowError:  # an int beyond a float's range
        return default
    return value if value == value and abs(value) != float("inf") else default
