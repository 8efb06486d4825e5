"""The straggler view of ``elasticstore status``: each beating rank's recent step time, from the
agents' status records, and which ranks are much slower than the others.

The measure of a rank is its median time spent in ``elasticstore.train.section`` blocks per step
over its last 8 beats (its own work, before it waits on its peers) when every reporting rank
uses sections, else its median step time (beat to beat; in a synchronous job every rank's step
takes the same wall time, so only sections show who holds the others up). A rank is a straggler
when its measure is at least ``STRAGGLER_RATIO`` times the median of the other ranks' measures
and at least ``STRAGGLER_MIN_GAP_S`` longer (a comparison with the others, not with the median of
all: with two ranks the median of all is their mean, and a rank twice as slow as its only peer
would never be marked).
"""

from __future__ import annotations

from typing import Any

from .terminal import printable

__all__ = ["STRAGGLER_MIN_GAP_S", "STRAGGLER_RATIO", "rank_rows", "straggler_lines"]

STRAGGLER_RATIO = 1.5
STRAGGLER_MIN_GAP_S = 0.005


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _rank(key: Any) -> int | None:
    """A rank from a record's key: ASCII digits only (``"²"`` is a digit to ``str.isdigit``
    but no number to ``int``), short enough to be a rank."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 9:
        return int(key)
    return None


def rank_rows(records: dict[str, dict[str, Any]], nodes: list[str]) -> list[dict[str, Any]]:
    """One row per beating rank of ``nodes`` (the round's members), sorted by rank, with its
    ``measure`` ("work" or "step"), ``ratio`` to the others' median and ``straggler``."""
    rows: list[dict[str, Any]] = []
    for node in nodes:
        ranks = records.get(node, {}).get("ranks")
        if not isinstance(ranks, dict):
            continue
        for rank, r in ranks.items():
            number = _rank(rank)
            if not isinstance(r, dict) or number is None:
                continue
            rows.append({"rank": number, "node": node, "step": r.get("step"),
                         "step_seconds": _number(r.get("step_seconds")),
                         "work_seconds": _number(r.get("work_seconds")),
                         "silent_seconds": _number(r.get("silent_seconds")),
                         "section": r.get("section")})
    rows.sort(key=lambda r: r["rank"])
    key = "work_seconds" if rows and all(r["work_seconds"] for r in rows) else "step_seconds"
    for r in rows:
        r["measure"], r["ratio"], r["straggler"] = key.split("_")[0], None, False
        mine = r[key]
        others = [o[key] for o in rows if o is not r and o[key] is not None]
        if mine is None or not others:
            continue
        middle = _median(others)
        if middle > 0:
            r["ratio"] = round(mine / middle, 2)
            r["straggler"] = mine >= STRAGGLER_RATIO * middle and mine - middle >= STRAGGLER_MIN_GAP_S
    return rows


def straggler_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Plain text: one line per rank (marked SLOW when a straggler)."""
    if not rows:
        return []
    lines = [f"ranks (median of the last 8 steps; {rows[0]['measure']} time compared):"]
    for r in rows:
        def sec(v: float | None) -> str:
            return f"{v:.3f}s" if v is not None else "-"
        ratio = f", {r['ratio']:.2f}x the others" if r["ratio"] is not None else ""
        # The node and the step come from the store: escaped like every other line.
        line = (f"  rank {r['rank']} on {r['node']}: step {r['step']}, step time "
                f"{sec(r['step_seconds'])}, work {sec(r['work_seconds'])}{ratio}, last beat "
                f"{sec(r['silent_seconds'])} ago" + ("  SLOW (straggler)" if r["straggler"] else ""))
        lines.append(printable(line))
    return lines
