"""The end of a node's run while other nodes may still need it: a node that hosts a store (the
rendezvous server or the round's worker store) keeps serving, bounded by ``drain_timeout``:

- after success, until every other participant finished and left (``finish``);
- after the run closed (``elasticstore stop``, or the restarts spent), until every other node
  left the rendezvous (``serve_until_left``): they must still read why the run closed.

(After a round change, whether a peer finished is the handler's ``peers_done``: its leaving then
ended the round, and only this node's workers are left to finish.) The keys in the round's store
are ``rendezvous.state.AgentKeys``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousInfo

from ..rendezvous.api import AgentRendezvous
from ..rendezvous.state import AgentKeys
from .logs import say

__all__ = ["WAIT_SLICE", "closed_reason", "finish", "mark_finished", "serve_until_left"]

WAIT_SLICE = 1.0  # seconds: the longest single wait between checks for a signal


def closed_reason(handler: AgentRendezvous) -> str | None:
    """Why the run was closed (``closing.FINISHED``, "stopped by operator", ...), None when open
    or when the store cannot say."""
    try:
        return handler.closed_reason()
    except Exception:
        return None


def stood_by(handler: AgentRendezvous) -> bool:
    """Whether this node joined the rendezvous while the run was open and waited for a place
    (``AgentSide.stood_by``; False for a handler that cannot say)."""
    return bool(getattr(handler, "stood_by", False))


def mark_finished(handler: AgentRendezvous) -> None:
    """Closes the run as finished (this node's workers succeeded): a peer whose round ends from
    now on reads that, and the run id is refused until ``elasticstore forget``."""
    try:
        handler.set_finished()
    except Exception as exc:
        say(f"[elasticstore-run] could not mark the run finished: {exc}")


def finish(info: RendezvousInfo, attempt: int, handler: AgentRendezvous, drain_timeout: float,
           clock: Callable[[], float], interrupted: Callable[[], bool],
           leave: Callable[[], None]) -> None:
    """Marks this node done (before it leaves, so the others never take its leaving for a lost
    node); a store host serves until every other node is done. Every node but rank 0 (the host
    of the round's store) then marks that it left the round's store, and rank 0 serves it until
    all did: a node that waits there never finds it gone. ``leave()`` withdraws this node from
    the rendezvous (a node that hosts nothing does so before its last mark)."""
    keys = AgentKeys(attempt)
    hosts = handler.hosts_store
    try:
        info.store.set(keys.done(info.rank), "host" if hosts else "node")
        if not hosts:
            store: Any = info.store
            store = store.clone()
            leave()
            store.set(keys.left(info.rank), "1")
            return
    except Exception as exc:
        say(f"[elasticstore-run] could not mark this node done: {exc}")
        return
    if info.world_size == 1:
        return
    say(f"[elasticstore-run] this node hosts a store: serving until all {info.world_size} "
        f"nodes finished (at most {drain_timeout:g}s)")
    deadline = clock() + drain_timeout
    done = [keys.done(i) for i in range(info.world_size)]
    if _wait_keys(info.store, done, deadline, clock, interrupted):
        if info.rank != 0:  # the rendezvous host: rank 0 serves the round's store until it read
            try:
                info.store.set(keys.left(info.rank), "1")
            except Exception:
                pass  # rank 0 stopped serving already
            return
        # Rank 0 serves the round's store: until every other node read what it waits for there.
        left = [keys.left(i) for i in range(1, info.world_size)]
        if _wait_keys(info.store, left, deadline, clock, interrupted):
            return
    say("[elasticstore-run] stopped serving: not every node finished in time")


def _wait_keys(store: Any, keys: list[str], deadline: float, clock: Callable[[], float],
               interrupted: Callable[[], bool]) -> bool:
    for _ in range(1 << 20):
        left = deadline - clock()
        if left <= 0:
            return False
        try:
            store.wait(keys, timedelta(seconds=min(WAIT_SLICE, left)))
            return True
        except Exception:
            if interrupted():
                return False
    return False


def serve_until_left(handler: AgentRendezvous, drain_timeout: float,
                     interrupted: Callable[[], bool]) -> None:
    """The run closed: a node hosting the rendezvous server serves until the others left."""

    def waiting(others: list[str]) -> None:
        say(f"[elasticstore-run] this node hosts the rendezvous store: serving until the other "
            f"{len(others)} node(s) left (at most {drain_timeout:g}s)")

    try:
        still = handler.serve_until_left(drain_timeout, interrupted, waiting)
    except Exception as exc:
        say(f"[elasticstore-run] serving the rendezvous store until the others left: {exc}")
        return
    if still:
        say(f"[elasticstore-run] stopped serving the rendezvous store; still there: "
            f"{', '.join(still[:8])}" + (f" and {len(still) - 8} more" if len(still) > 8 else ""))
