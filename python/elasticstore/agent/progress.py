"""What the nodes of a job tell each other about their ranks' progress, so that no node judges a
rank hung while the job is busy elsewhere (``hangs.py`` decides, this module carries the facts).

Each agent of a multi-node job keeps a ``progress`` entry in its status record (the rendezvous
store, ``elasticstore status``), rewritten only when it changes:

    {"attempt": 3,            the round's attempt (records of another round are ignored)
     "beaten": true,          a rank of this node has beaten in this round
     "sections": [{"rank": 0, "name": "eval", "until": 1764236400.5 | null}]}

``sections`` lists the local ranks inside a section open longer than ``LONG_SHARE`` of the
heartbeat timeout (short ones, such as a step's ``section("compute")``, end before that and are
never written: no store write per step), with the wall-clock time the section expires (null: no
timeout). Another node reads the records only when it is about to judge a rank: a rank of the
job inside a section that has not expired holds every verdict (the others wait for it in a
collective), and a rank that beat this round shows that the job makes progress.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from ..train.heartbeat_layout import NO_DEADLINE, SlotView

__all__ = ["LONG_SHARE", "PeerProgress", "local_progress", "open_section", "public", "same"]

LONG_SHARE = 0.25  # a section open longer than this share of the heartbeat timeout is published
READ_EVERY_S = 1.0  # the others' records are read at most this often (or a quarter timeout)


def _open(view: SlotView, now_ns: int) -> bool:
    """Whether ``view`` is inside a section that has not expired."""
    until = view.section_until_ns
    return until == NO_DEADLINE or (until != 0 and now_ns < until)


def open_section(views: Iterable[tuple[int, SlotView]], now_ns: int) -> str | None:
    """The first of (rank, view) inside a section that has not expired, described; else None."""
    for rank, v in views:
        if _open(v, now_ns):
            left = "no timeout" if v.section_until_ns == NO_DEADLINE else \
                f"{(v.section_until_ns - now_ns) / 1e9:.1f}s left of its timeout"
            return f"rank {rank} is in section {v.section!r} ({left})"
    return None


def local_progress(attempt: int, views: Iterable[tuple[int, SlotView]], long_s: float,
                   now_ns: int) -> dict[str, Any]:
    """This node's entry (see the module doc); ``views``: (global rank, slot) of each worker."""
    beaten, sections = False, []
    wall = time.time()
    for rank, v in views:
        beaten = beaten or v.beats > 0
        if _open(v, now_ns) and now_ns - v.section_from_ns > long_s * 1e9:
            until = None if v.section_until_ns == NO_DEADLINE else \
                round(wall + (v.section_until_ns - now_ns) / 1e9, 3)
            sections.append({"rank": rank, "name": v.section, "until": until,
                             "from_ns": v.section_from_ns})
    return {"attempt": attempt, "beaten": beaten, "sections": sections}


def same(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    """Whether two entries say the same (a section's ``until`` is recomputed on every read)."""
    if a is None:
        return False

    def key(p: dict[str, Any]) -> tuple[Any, ...]:
        return (p["attempt"], p["beaten"], tuple((s["rank"], s["from_ns"]) for s in p["sections"]))

    return key(a) == key(b)


def public(entry: dict[str, Any]) -> dict[str, Any]:
    """The entry as written to the store (without the local clock's ``from_ns``)."""
    sections = [{k: v for k, v in s.items() if k != "from_ns"} for s in entry["sections"]]
    return dict(entry, sections=sections)


class PeerProgress:
    """The other nodes' entries, read through ``read`` (the handler's ``peer_statuses``; any
    error: nothing known) at most every ``every`` seconds (at least ``READ_EVERY_S``; a quarter
    of the heartbeat timeout keeps a thousand nodes holding a verdict from flooding the store).
    Read only while a verdict is due here: a job that beats reads nothing."""

    def __init__(self, read: Callable[[], list[dict[str, Any]]] | None,
                 every: float = READ_EVERY_S) -> None:
        self._read, self._every = read, max(READ_EVERY_S, every)
        self._at = -self._every
        self._records: list[dict[str, Any]] = []

    def _entries(self, attempt: int) -> list[tuple[str, dict[str, Any]]]:
        now = time.monotonic()
        if self._read is not None and now - self._at >= self._every:
            self._at = now
            try:
                self._records = self._read()
            except Exception:
                self._records = []
        out = []
        for rec in self._records:
            p = rec.get("progress")
            if isinstance(p, dict) and p.get("attempt") == attempt:
                out.append((str(rec.get("host") or rec.get("node") or "?"), p))
        return out

    def open_section(self, attempt: int) -> str | None:
        """A rank of another node inside a section that has not expired, described; else None."""
        wall = time.time()
        for host, p in self._entries(attempt):
            for s in p.get("sections") or []:
                until = s.get("until")
                if until is None or float(until) > wall:
                    left = "no timeout" if until is None else f"{float(until) - wall:.1f}s left " \
                        "of its timeout"
                    return f"rank {s.get('rank')} on {host} is in section {s.get('name')!r} ({left})"
        return None

    def beaten(self, attempt: int) -> bool:
        """Whether a rank of another node has beaten in this round."""
        return any(p.get("beaten") for _, p in self._entries(attempt))
