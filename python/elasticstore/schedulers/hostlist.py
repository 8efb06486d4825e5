"""Slurm's compressed host lists, expanded: ``n[1-3,5],gpu[01-02]`` -> ``n1 n2 n3 n5 gpu01 gpu02``.

The syntax ``scontrol show hostnames`` reads: entries separated by commas outside brackets; in
an entry, each ``[...]`` holds comma-separated numbers and ``lo-hi`` ranges, zero-padded to the
width written (``[08-10]`` -> ``08 09 10``); several bracket groups in one entry multiply
(``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``), in Slurm's order. A malformed list raises
:class:`HostListError` naming it, never a guess.
"""

from __future__ import annotations

import itertools

__all__ = ["HostListError", "expand"]

MAX_HOSTS = 1 << 20  # a list naming more hosts than this is refused (a typo like [1-99999999])


class HostListError(ValueError):
    """A host list that is not Slurm's syntax."""


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostListError(f"host list {text!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostListError(f"host list {text!r}: ']' without '['")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise HostListError(f"host list {text!r}: '[' without ']'")
    parts.append(text[start:])
    return parts


def _numbers(text: str, whole: str) -> list[str]:
    """The inside of one bracket group: ``1-3,05`` -> ``1 2 3 05``."""
    out: list[str] = []
    for item in text.split(","):
        lo, dash, hi = item.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise HostListError(f"host list {whole!r}: [{text}]: {item!r} is not N or N-M")
        if not dash:
            out.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a:
            raise HostListError(f"host list {whole!r}: [{text}]: range {item!r} runs backwards")
        if b - a >= MAX_HOSTS:
            raise HostListError(f"host list {whole!r}: [{text}]: range {item!r} is too long")
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        out.extend(str(n).zfill(width) for n in range(a, b + 1))
    return out


def _entry(entry: str, whole: str) -> list[str]:
    """One entry (``rack[1-2]-n[01-02]``) -> its host names."""
    pieces: list[list[str]] = []
    rest = entry
    while rest:
        open_at = rest.find("[")
        if open_at < 0:
            pieces.append([rest])
            break
        close_at = rest.index("]", open_at)
        if open_at:
            pieces.append([rest[:open_at]])
        pieces.append(_numbers(rest[open_at + 1:close_at], whole))
        rest = rest[close_at + 1:]
    return ["".join(p) for p in itertools.product(*pieces)]


def expand(text: str) -> list[str]:
    """Every host of Slurm's compressed list ``text``, in order (duplicates kept, as Slurm's)."""
    text = text.strip()
    if not text or text == "(null)":
        raise HostListError(f"host list {text!r}: empty")
    hosts: list[str] = []
    for entry in _split_top(text):
        entry = entry.strip()
        if not entry:
            raise HostListError(f"host list {text!r}: an empty entry")
        hosts.extend(_entry(entry, text))
        if len(hosts) > MAX_HOSTS:
            raise HostListError(f"host list {text!r}: more than {MAX_HOSTS} hosts")
    return hosts
