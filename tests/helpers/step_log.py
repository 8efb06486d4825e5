"""Reads what ``programs/steps_train.py`` records and checks the property that matters for the
store-host failover: under one run id, two groups never train in overlapping time."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

from paths import program

STEPS_TRAIN = program("steps_train.py")


@dataclass(frozen=True)
class Group:
    """One worker group: the steps its ranks completed, as one interval: from the earliest moment
    its first step's all_reduce can have completed to the latest its last one can have. A step
    completes for all ranks at once, after every rank entered it (its ``t0``s) and before any rank
    noted its end (its ``t1``s): a rank stopped (SIGSTOP, no CPU) between the all_reduce and its
    note does not stretch the interval past the step."""

    run: str
    attempt: int
    store: str
    world: int
    first: float  # the first step: its ranks' latest start
    last: float  # the last step: its ranks' earliest end
    steps: int
    ranks: frozenset[int]
    restarts: int
    hosts: frozenset[str]
    members: frozenset[tuple[str, int]]  # (node, incarnation)

    def describe(self) -> str:
        return (f"attempt {self.attempt} store {self.store} world {self.world} ranks "
                f"{sorted(self.ranks)}: {self.steps} steps in [{self.first:.3f}, {self.last:.3f}]")


def groups(directory: str) -> list[Group]:
    """Every group that completed a step, by (run, attempt, store), oldest first."""
    found: dict[tuple[str, int, str], list[dict[str, object]]] = {}
    for path in glob.glob(os.path.join(directory, "steps-*.jsonl")):
        with open(path) as f:
            for line in f:
                if line.endswith("\n"):  # a line cut by a SIGKILL is not a step
                    rec = json.loads(line)
                    found.setdefault((str(rec["run"]), int(rec["attempt"]), str(rec["store"])),
                                     []).append(rec)
    out = []
    for (run, attempt, store), recs in found.items():
        worlds = {int(r["world"]) for r in recs}  # type: ignore[call-overload]
        assert len(worlds) == 1, (run, attempt, store, worlds)
        steps: dict[object, list[dict[str, object]]] = {}
        for i, r in enumerate(recs):  # a record of each rank, one step; without a number: its own
            steps.setdefault(r.get("step", ("record", i)), []).append(r)
        windows = [(max(float(r["t0"]) for r in step), min(float(r["t1"]) for r in step))  # type: ignore[arg-type]
                   for step in steps.values()]
        out.append(Group(run, attempt, store, worlds.pop(), min(w[0] for w in windows),
                         max(w[1] for w in windows), len(recs),
                         frozenset(int(r["rank"]) for r in recs),  # type: ignore[call-overload]
                         max(int(r.get("restarts", 0)) for r in recs),  # type: ignore[call-overload]
                         frozenset(str(r.get("host", "")) for r in recs),
                         frozenset((str(r.get("host", "")), int(r.get("incarnation", 0)))  # type: ignore[call-overload]
                                   for r in recs)))
    return sorted(out, key=lambda g: g.first)


def overlaps(found: list[Group]) -> list[tuple[Group, Group]]:
    """Pairs of groups of one run whose training intervals overlap (two groups at once)."""
    bad = []
    for i, a in enumerate(found):
        for b in found[i + 1:]:
            if a.run == b.run and a.first < b.last and b.first < a.last:
                bad.append((a, b))
    return bad


def formed_since(directory: str, since: float, world: int | None = None) -> Group | None:
    """A group whose first step started after ``since`` (of ``world`` when given): a round that
    formed after an event, not the last steps of the round the event ended."""
    for g in reversed(groups(directory)):
        if g.first > since and (world is None or g.world == world):
            return g
    return None


def trained_since(directory: str, since: float, world: int | None = None) -> Group | None:
    """A group that completed a step starting after ``since`` (of ``world`` when given)."""
    for g in reversed(groups(directory)):
        if g.last > since and (world is None or g.world == world):
            return g
    return None
