"""torchrun's ``--rdzv-conf`` form, ``key=value,...``, tolerant of the quotes a shell or a caller
left in it: ``'join_timeout=5,timeout=5'`` (the whole value quoted, as torch's launcher tests
pass it) and ``key="value"``. Torch-free, so the launcher parses it before importing torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["parse_pairs", "unquote_config"]

_QUOTES = ("'", '"')


def _unwrap(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in _QUOTES:
        return text[1:-1].strip()
    return text


def unquote_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as torch's parser split it, without the quotes: a quote opening the first key
    and closing the last value wrapped the whole string; a value may be quoted on its own."""
    items = [(str(k).strip(), v.strip() if isinstance(v, str) else v) for k, v in config.items()]
    if items and isinstance(items[-1][1], str):
        first, last = items[0][0], items[-1][1]
        if first[:1] in _QUOTES and last.endswith(first[0]):
            items[0] = (first[1:].strip(), items[0][1])
            items[-1] = (items[-1][0], items[-1][1][:-1].strip())
    return {_unwrap(k): _unwrap(v) if isinstance(v, str) else v for k, v in items}


def parse_pairs(text: str) -> tuple[tuple[str, str], ...]:
    """``key=value,...`` -> pairs; ``ValueError`` naming an item that is not ``key=value``."""
    pairs: list[tuple[str, str]] = []
    for item in filter(None, (i.strip() for i in _unwrap(str(text)).split(","))):
        key, eq, val = item.partition("=")
        if not eq or not _unwrap(key):
            raise ValueError(f"{item!r} is not key=value")
        pairs.append((key, val))
    return tuple(unquote_config(dict(pairs)).items())
