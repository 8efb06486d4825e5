"""Entering a round: ``next_rendezvous`` in a thread of its own (a signal is handled at once),
and the ranks of this node's workers (each node publishes its worker count in the round's store
and reads the others')."""

from __future__ import annotations

import json
import selectors
import signal
import socket
import threading
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousInfo

from ..rendezvous.api import AgentRendezvous
from ..rendezvous.records import int_field, parse_record
from ..rendezvous.state import AgentKeys
from .forkclient import ForkServer
from .job_imports import preload_job_imports, reread_job_imports
from .logs import say

__all__ = ["ASSIGN_TIMEOUT", "RendezvousCall", "assign", "say_moves", "say_round"]

ASSIGN_TIMEOUT = 300.0  # seconds: waiting for every node's worker count in the round's store


class RendezvousCall:
    """``handler.next_rendezvous()`` in a daemon thread (``thread``), started at once. With
    ``warm`` (a node's first round) the thread first has that fork server import what the job's
    workers import on the other nodes (``preload_job_imports``) and waits for it to be warm
    (torch imported): a node joining a running job (a replacement, a standby, a scale-up) then
    ends the others' round only when its workers can start at once, not while it still imports.
    The call is not made when the agent stopped waiting meanwhile (a signal)."""

    def __init__(self, handler: AgentRendezvous, warm: ForkServer | None = None) -> None:
        self._result: dict[str, Any] = {}
        self._done_r, done_w = socket.socketpair()
        self._abandoned = threading.Event()
        result, abandoned = self._result, self._abandoned

        def target() -> None:
            joined = threading.Event()  # set: the call returned (the list is read no more)
            try:
                if warm is not None:
                    taught = preload_job_imports(handler, warm)
                    warm.wait_warm()
                    threading.Thread(target=reread_job_imports, args=(handler, warm, taught,
                                     joined), name="job-imports", daemon=True).start()
                if abandoned.is_set():
                    raise InterruptedError("the agent stopped waiting for the rendezvous")
                result["info"] = handler.next_rendezvous()
            except BaseException as exc:
                result["error"] = exc
            finally:
                joined.set()
                try:
                    done_w.send(b"x")
                except OSError:
                    pass  # the agent stopped waiting (a signal): nobody reads the result
                finally:
                    done_w.close()

        self.thread = threading.Thread(target=target, name="rendezvous", daemon=True)
        self.thread.start()

    def wait(self, sig_r: socket.socket) -> RendezvousInfo | int:
        """The round, or the number of the signal that came first on ``sig_r`` (the agent's
        wakeup socket); raises what ``next_rendezvous`` raised."""
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self._done_r, selectors.EVENT_READ)
                sel.register(sig_r, selectors.EVENT_READ)
                for _ in range(1 << 40):
                    for key, _ in sel.select():
                        if key.fileobj is sig_r:
                            sigs = sig_r.recv(64)
                            say(f"[elasticstore-run] got {signal.Signals(sigs[0]).name} in the rendezvous")
                            self._abandoned.set()
                            return sigs[0]
                        if "error" in self._result:
                            raise self._result["error"]
                        info: RendezvousInfo = self._result["info"]
                        return info
            return 1
        finally:
            self._done_r.close()


def _node_of(value: bytes, node: int) -> tuple[int, int]:
    """A node's (worker count, failure restarts it knows of) from its record in the round's
    store (validated: the store is input)."""
    record = parse_record(value, f"node {node}'s worker count")
    nproc, restarts = int_field(record, "nproc"), int_field(record, "restarts")
    if nproc is None or nproc < 1:
        raise ValueError(f"node {node}'s worker count is not a positive integer: {value[:80]!r}")
    if restarts is None or restarts < 0:
        raise ValueError(f"node {node}'s restart count is not an integer >= 0: {value[:80]!r}")
    return nproc, restarts


def assign(info: RendezvousInfo, attempt: int, nproc: int, restarts: int = 0) -> tuple[int, int, int]:
    """(first global rank here, world size, restart count): this node publishes its worker count
    and the job's failure restarts as it knows them (the last round's count, plus one when its
    own failure ended that round) in the round's store and reads the others' (one set, one wait,
    one multi_get). The restart count, the largest known, is the same on every node: torch's
    ``TORCHELASTIC_RESTART_COUNT`` counts restarts after failures, never membership changes."""
    store, keys = info.store, AgentKeys(attempt)
    store.set(keys.node(info.rank), json.dumps({"nproc": nproc, "restarts": restarts}))
    names = [keys.node(i) for i in range(info.world_size)]
    store.wait(names, timedelta(seconds=ASSIGN_TIMEOUT))
    nodes = [_node_of(v, node) for node, v in enumerate(store.multi_get(names))]
    counts = [n for n, _ in nodes]
    return sum(counts[: info.rank]), sum(counts), max(r for _, r in nodes)


def say_moves(handler: AgentRendezvous, events: Any, seen: int) -> int:
    """Says and records (``store_moved`` event) the switches of the rendezvous store's host
    after the first ``seen``; returns how many there are now."""
    moves = handler.store_moves
    for move in moves[seen:]:
        say(f"[elasticstore-run] the rendezvous store moved from {move.previous} to "
            f"{move.endpoint} (epoch {move.epoch})")
        events.emit("store_moved", previous=move.previous, endpoint=move.endpoint,
                    epoch=move.epoch, node=move.node, since=move.since)
    return len(moves)


def say_round(handler: AgentRendezvous, info: RendezvousInfo, base: int, world: int, nproc: int,
              rdzv: float, start: float) -> None:
    """The console line of a round this node's workers started in."""
    rnd = handler.round
    members = f" [{', '.join(rnd.participants)}]" if rnd is not None else ""
    number = f" {rnd.round}" if rnd is not None else ""
    say(f"[elasticstore-run] round{number}: {info.world_size} node(s){members}, world size "
        f"{world}; node rank {info.rank}, ranks {base}-{base + nproc - 1}; rendezvous "
        f"{rdzv:.3f}s, workers started in {start:.3f}s")
