"""The agent's replica service: a receiver and a sender (one each per agent, for its whole run)
and, each round, the ring: node ``i`` of the round's ``n`` nodes sends to node ``(i + 1) % n``.

Each agent publishes its receiver's address in the round's store (``key``) once its workers
started; a thread of its own then looks for its successor's and its predecessor's (they publish
at about the same moment, right after the round's worker counts), asking the store whether they
are there every ``POLL_S`` (short calls: the agent's own use of the store never waits behind a
blocking wait), for at most ``LOOKUP_S``. The agent is never held up: a neighbour lost before it
published costs that round's replicas (said), not the agent's watch over its workers. A round of
one node has no ring: the sender idles, the area's hold file is removed (its workers keep their
two newest snapshots only), and what the receiver holds stays (the replicas of a node just lost
are what this node restores from). A round of two nodes or more runs its schedule
(``schedule.py``): which step is sent, and which steps the workers keep for it.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from ..train.snapshots.hold import remove_hold
from .receiver import Receiver
from .schedule import Schedule
from .sender import Sender

__all__ = ["LOOKUP_S", "ReplicaService", "key"]

LOOKUP_S = 60.0  # looking for the ring neighbours' addresses in the round's store
POLL_S = 0.1
_MAX_RECORD = 1024


def key(attempt: int, node_rank: int) -> str:
    return f"elasticstore/replicas/{attempt}/{node_rank}"


def _parse(value: bytes, node: int) -> tuple[str, int]:
    if len(value) > _MAX_RECORD:
        raise ValueError(f"node {node}'s replica address is {len(value)} bytes")
    try:
        record = json.loads(value)
        host, port = record["host"], record["port"]
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"node {node}'s replica address {value[:80]!r}: {err}") from None
    if not (isinstance(host, str) and host and type(port) is int and 0 < port < 65536):
        raise ValueError(f"node {node}'s replica address {value[:80]!r}")
    return host, port


class ReplicaService:
    """Replicas of this node's sharded snapshots (``area``) on the ring successor, and of the
    predecessor's here (``area/replicas/``). ``host``: this node's address (the receiver binds
    it); ``token``: the run's ("" none)."""

    def __init__(self, area: str, nproc: int, host: str, token: str,
                 log: Callable[[str], None] = lambda _: None) -> None:
        self.host, self.area, self._log = host, area, log
        self._round = 0  # new_round's count: a lookup of an earlier round gives up
        self._lock = threading.Lock()
        self._schedule: Schedule | None = None
        self._committed: int | None = None  # the last committed step (an earlier round's)
        self.receiver = Receiver(area, host, token, log)
        try:
            self.sender = Sender(area, nproc, uuid.uuid4().hex, token, host, log,
                                 self.receiver.own_written, planned=True)
        except BaseException:
            self.receiver.close()
            raise

    def new_round(self, store: Any, attempt: int, node_rank: int, nnodes: int) -> None:
        """Publishes this receiver's address in the round's ``store``; a thread then points the
        sender at the successor and lets the predecessor in, once both published (module doc)."""
        with self._lock:
            self._round += 1
            number = self._round
            self.sender.set_target(None)
            self.receiver.allow(set())
        self._stop_schedule()
        self.receiver.new_round(attempt)
        self.sender.new_round(attempt, time.time_ns())
        store.set(key(attempt, node_rank),
                  json.dumps({"host": self.host, "port": self.receiver.port}))
        if nnodes < 2:
            remove_hold(self.area)
            return
        succ, pred = (node_rank + 1) % nnodes, (node_rank - 1) % nnodes
        threading.Thread(target=self._find, args=(store, number, attempt, succ, pred),
                         name="replica-ring", daemon=True).start()
        self._schedule = Schedule(store, attempt, node_rank, nnodes, self.sender, self.area,
                                  self._committed, self._log)

    def _stop_schedule(self) -> None:
        schedule, self._schedule = self._schedule, None
        if schedule is not None:
            schedule.stop()
            self._committed = schedule.committed

    def _find(self, store: Any, number: int, attempt: int, succ: int, pred: int) -> None:
        names = [key(attempt, succ), key(attempt, pred)]
        deadline = time.monotonic() + LOOKUP_S
        try:
            while not store.check(names):
                if self._round != number:
                    return  # a newer round (or close)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not published within {LOOKUP_S:.0f}s")
                time.sleep(POLL_S)
            (s_host, s_port), (p_host, _) = (
                _parse(v, n) for v, n in zip(store.multi_get(names), (succ, pred)))
            preds = {str(info[4][0]) for info in socket.getaddrinfo(p_host, None)}
        except Exception as err:  # the store's errors, a bad record, a name that does not resolve
            if self._round == number:
                self._log(f"[elasticstore-run] no replicas this round: the ring neighbours' "
                          f"addresses ({type(err).__name__}: {err})")
            return
        with self._lock:
            if self._round == number:
                self.receiver.allow(preds)
                self.sender.set_target((s_host, s_port))

    def close(self) -> None:
        with self._lock:
            self._round += 1  # a lookup in progress gives up
        self._stop_schedule()
        self.sender.close()
        self.receiver.close()
