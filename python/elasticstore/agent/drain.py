"""The end of a node's run while other nodes may still need it: a node that hosts a store (the
rendezvous server or the round's worker store) keeps serving, bounded by ``drain_timeout``:

- after success, until every other participant finished and left (``finish``);
- after the run closed (``elasticstore stop``, or the restarts spent), until every other node
  left the rendezvous (``serve_until_left``): they must still read why the run closed.

And, after a round change, whether a peer finished (``peers_done``): its leaving then ended the
round, and only this node's workers are left to finish.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

from ..stores.native.token import read_token_file
from ..stores.native.store import Store
from .logs import say

__all__ = ["PEER_CHECK_TIMEOUT", "WAIT_SLICE", "finish", "mark_finished", "peers_done",
           "serve_until_left"]

PEER_CHECK_TIMEOUT = 0.5  # seconds: asking the round's store whether a peer finished
WAIT_SLICE = 1.0  # seconds: the longest single wait between checks for a signal


def peers_done(info: RendezvousInfo, attempt: int, token_file: str | None) -> bool:
    """Whether another node finished. On a connection of its own with a short deadline: the
    round's store may have gone with its host."""
    boot = info.bootstrap_store_info
    if boot is None:
        return False
    prefix, quick = f"elasticstore/agent/{attempt}/done/", timedelta(seconds=PEER_CHECK_TIMEOUT)
    try:
        token = read_token_file(token_file) if token_file else None
        with Store(boot.master_addr, boot.master_port, timeout=quick, connect_timeout=quick,
                   token=token) as st:
            return any(st.try_get(prefix + str(i)) is not None for i in range(info.world_size))
    except Exception:
        return False


def mark_finished(handler: RendezvousHandler) -> None:
    """Closes the run as finished (this node's workers succeeded): a peer whose round ends from
    now on reads that, and the run id is refused until ``elasticstore forget``."""
    set_finished = getattr(handler, "set_finished", None)
    if set_finished is not None:
        try:
            set_finished()
        except Exception as exc:
            say(f"[elasticstore-run] could not mark the run finished: {exc}")


def finish(info: RendezvousInfo, attempt: int, handler: RendezvousHandler, drain_timeout: float,
           clock: Callable[[], float], interrupted: Callable[[], bool],
           leave: Callable[[], None]) -> None:
    """Marks this node done (before it leaves, so the others never take its leaving for a lost
    node); a store host serves until every other node is done. Every node but rank 0 (the host
    of the round's store) then marks that it left the round's store, and rank 0 serves it until
    all did: a node that waits there never finds it gone. ``leave()`` withdraws this node from
    the rendezvous (a node that hosts nothing does so before its last mark)."""
    prefix = f"elasticstore/agent/{attempt}/"
    hosts = bool(getattr(handler, "hosts_store", info.rank == 0))
    try:
        info.store.set(prefix + f"done/{info.rank}", "host" if hosts else "node")
        if not hosts:
            store: Any = info.store
            store = store.clone()
            leave()
            store.set(prefix + f"left/{info.rank}", "1")
            return
    except Exception as exc:
        say(f"[elasticstore-run] could not mark this node done: {exc}")
        return
    if info.world_size == 1:
        return
    say(f"[elasticstore-run] this node hosts a store: serving until all {info.world_size} "
        f"nodes finished (at most {drain_timeout:g}s)")
    deadline = clock() + drain_timeout
    done = [prefix + f"done/{i}" for i in range(info.world_size)]
    if _wait_keys(info.store, done, deadline, clock, interrupted):
        if info.rank != 0:  # the rendezvous host: rank 0 serves the round's store until it read
            try:
                info.store.set(prefix + f"left/{info.rank}", "1")
            except Exception:
                pass  # rank 0 stopped serving already
            return
        # Rank 0 serves the round's store: until every other node read what it waits for there.
        left = [prefix + f"left/{i}" for i in range(1, info.world_size)]
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


def serve_until_left(handler: RendezvousHandler, drain_timeout: float,
                     interrupted: Callable[[], bool]) -> None:
    """The run closed: a node hosting the rendezvous server serves until the others left."""
    serve = getattr(handler, "serve_until_left", None)
    if serve is None:
        return

    def waiting(others: list[str]) -> None:
        say(f"[elasticstore-run] this node hosts the rendezvous store: serving until the other "
            f"{len(others)} node(s) left (at most {drain_timeout:g}s)")

    try:
        still = serve(drain_timeout, interrupted, waiting)
    except Exception as exc:
        say(f"[elasticstore-run] serving the rendezvous store until the others left: {exc}")
        return
    if still:
        say(f"[elasticstore-run] stopped serving the rendezvous store; still there: "
            f"{', '.join(still[:8])}" + (f" and {len(still) - 8} more" if len(still) > 8 else ""))
