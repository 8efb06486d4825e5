"""The replica schedule of a round: the agents agree on one step to replicate, their workers keep
its memory while it is sent, and once every node's replica of it is placed it is *committed*: a
node lost from then on leaves every survivor holding that step in its own memory and the lost
node's successor holding the lost node's replica of it.

The agent of node rank 0 of the round leads. Through the round's store (under
``elasticstore/replicas/<attempt>/``):

- ``plan``, written by the leader: ``{"n": number, "floor": t, "committed": c}``. ``t`` is the
  leader's newest complete step written in this round plus ``gap`` (1 at first): a step not yet
  taken, so no node has reused its memory; ``c`` the newest committed step (null: none yet in
  this round).
- ``done/<node rank>``, one per agent: ``{"n": number, "step": s}``, the step it placed on its
  successor for that plan (its local ranks' oldest step ``>= t``: the same step on every node,
  as all ranks snapshot on the same steps; ``Sender``), or -1: missed (its ranks' oldest steps
  differ, or a file was taken for a newer step while sent: its workers reused the step's memory
  before they saw the hold).

Every agent (the leader too) reads the plan every ``POLL_S``; at a new one it writes its area's
hold file (``train/snapshots/hold.py``: its workers never reuse the memory of step ``c``, nor of
their oldest step ``>= t``) and points its sender at it, and reports the sender's outcome. When
every node reported the same step ``s``, the leader publishes the next plan, committing ``s``,
with a new floor; when two reports differ or one missed, the next plan keeps ``c``, and the floor
moves ``gap`` steps past the leader's newest, ``gap`` doubled (at most ``MAX_GAP``; said once
per round). Before the round's first commit the hold keeps the previous round's committed step
(``carried``: what a restore in this round could still need).

One thread per round, never the agent's: every store call is a short one (check, get, set,
multi_get: no blocking wait), and the thread ends with the round (``stop``). A store that fails
is asked again at the next look, unsaid (the round's store closes when the round ends, before the
next round stops this thread; a store failing mid-round is the agent's to say). A lost leader
stops the commits; what every node holds stays held until the next round.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

from ..train.snapshots.hold import Hold, write_hold
from .sender import Sender

__all__ = ["MAX_GAP", "POLL_S", "Schedule", "done_key", "plan_key"]

POLL_S = 0.1
MAX_GAP = 16
_MAX_RECORD = 1024


def plan_key(attempt: int) -> str:
    return f"elasticstore/replicas/{attempt}/plan"


def done_key(attempt: int, node_rank: int) -> str:
    return f"elasticstore/replicas/{attempt}/done/{node_rank}"


def _record(value: bytes, fields: tuple[str, ...]) -> dict[str, Any]:
    if len(value) > _MAX_RECORD:
        raise ValueError(f"a replica schedule record of {len(value)} bytes")
    record = json.loads(value)
    if not (isinstance(record, dict) and set(fields) <= set(record) and
            all(record[f] is None or type(record[f]) is int for f in fields) and
            type(record[fields[0]]) is int):
        raise ValueError(f"a replica schedule record {value[:80]!r}")
    return record


class Schedule:
    """The schedule of round ``attempt`` for this agent (``node_rank`` of ``nnodes``), on a
    thread of its own from construction to ``stop``. ``committed``: the newest step committed
    (in this round, else ``carried``)."""

    def __init__(self, store: Any, attempt: int, node_rank: int, nnodes: int, sender: Sender,
                 area: str, carried: int | None, log: Callable[[str], None]) -> None:
        self._store, self._attempt, self._node, self._nnodes = store, attempt, node_rank, nnodes
        self._sender, self._area, self._log = sender, area, log
        self.committed = carried
        self._lock = threading.Lock()  # stop() against a hold or plan being set
        self._stopped = threading.Event()
        self._seen: int | None = None  # the plan number this agent follows
        self._reported: tuple[tuple[int, int], int] | None = None
        self._lag_said = self._miss_said = self._error_said = False
        # the leader's
        self._plan: tuple[int, int, int | None] | None = None  # (number, floor, committed)
        self._gap = 1
        self._reports = False  # every node reported once (the keys exist)
        self._thread = threading.Thread(target=self._run, name="replica-schedule", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No hold written nor plan set after this returns; the thread ends at its next look."""
        with self._lock:
            self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(POLL_S):
            try:
                if self._node == 0:
                    self._lead()
                self._follow()
            except ValueError as err:  # a record that is not the schedule's
                if not self._error_said and not self._stopped.is_set():
                    self._error_said = True
                    self._log(f"[elasticstore-run] replica schedule: {err}")
            except Exception:  # the store's: its round ended (closed), or the agent says so
                pass

    def _follow(self) -> None:
        key = plan_key(self._attempt)
        if self._seen is None and not self._store.check([key]):
            return  # (once it exists, one get a look)
        plan = _record(self._store.get(key), ("n", "floor", "committed"))
        if plan["n"] != self._seen:
            if plan["committed"] is not None:
                self.committed = plan["committed"]
            with self._lock:
                if self._stopped.is_set():
                    return
                write_hold(self._area, Hold(self.committed, plan["floor"]))
                self._sender.set_plan((self._attempt, plan["n"]), plan["floor"], self.committed)
            self._seen = plan["n"]
            self._say_lag(plan["committed"])
        result = self._sender.result
        if result is not None and result[0] == (self._attempt, self._seen) and \
                result != self._reported:
            self._store.set(done_key(self._attempt, self._node),
                            json.dumps({"n": self._seen, "step": result[1]}))
            self._reported = result

    def _lead(self) -> None:
        newest = self._sender.newest
        if self._plan is None:
            if newest is not None:
                self._publish(1, newest + self._gap, None)
            return
        number, floor, committed = self._plan
        keys = [done_key(self._attempt, i) for i in range(self._nnodes)]
        if not self._reports:
            if not self._store.check(keys):
                return
            self._reports = True
        reports = [_record(v, ("n", "step")) for v in self._store.multi_get(keys)]
        steps = [r["step"] for r in reports if r["n"] == number]
        base = floor if newest is None else max(newest, floor)
        if -1 in steps or len(set(steps)) > 1:
            self._gap = min(2 * self._gap, MAX_GAP)
            if not self._miss_said:
                self._miss_said = True
                self._log(f"[elasticstore-run] replicas: the nodes placed steps {sorted(set(steps))} "
                          f"for the floor {floor} (-1: missed; the workers reused that step's "
                          "memory before they saw the hold): the floor moves ahead by "
                          f"{self._gap} steps from now on")
            self._publish(number + 1, base + self._gap, committed)
        elif len(steps) == self._nnodes:
            self._publish(number + 1, max(base + self._gap, steps[0] + 1), steps[0])

    def _publish(self, number: int, floor: int, committed: int | None) -> None:
        self._store.set(plan_key(self._attempt),
                        json.dumps({"n": number, "floor": floor, "committed": committed}))
        self._plan = (number, floor, committed)

    def _say_lag(self, committed: int | None) -> None:
        newest = self._sender.newest
        if committed is None or newest is None or newest - committed < 2 or self._lag_said:
            return
        self._lag_said = True
        self._log(f"[elasticstore-run] replicas: the committed step {committed} is "
                  f"{newest - committed} steps behind the workers (step {newest}; its copy took "
                  f"{self._sender.last_s:.2f}s): a node lost now resumes from step {committed} "
                  "or a newer step every survivor holds (snapshot less often, or a faster "
                  "network between the nodes, to lose fewer)")
