"""What an elastic agent may call on a rendezvous handler: :class:`AgentRendezvous`.

torch's ``RendezvousHandler`` methods plus the parts an elasticstore agent uses at its wait point
and at the end of a run. elasticstore's own handler (``handler.py``) implements all of it; any
other handler (the static backend, torch's handlers through the plugin path) is adapted once by
:func:`as_agent_rendezvous`, which supplies the parts it lacks (no round record, no status, a
round watch that asks ``num_nodes_waiting()`` every poll interval). The agent calls the
rendezvous through this Protocol only.

Errors: a lost rendezvous store is ``RendezvousConnectionError``; a closed rendezvous
``RendezvousClosedError``; a join that took too long ``RendezvousTimeoutError`` (torch's).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

if TYPE_CHECKING:
    from .failover import HostRecord
    from .state import RoundState

__all__ = ["AgentRendezvous", "BasicRendezvous", "PollWatch", "RoundWatchLike",
           "as_agent_rendezvous"]


class RoundWatchLike(Protocol):
    """A watch on the current round's end (``watch_round``)."""

    def wait(self, timeout: float) -> bool:
        """Blocks until the round must be replaced (True) or ``timeout`` seconds passed
        (False); ends at once, False, after ``close()``."""

    def close(self) -> None:
        """Ends a ``wait`` in progress (from any thread); idempotent."""


@runtime_checkable
class AgentRendezvous(Protocol):
    """A rendezvous handler as an agent uses it. Methods may be called from the agent's thread
    and, where said, from another; none blocks longer than stated."""

    # -- torch's RendezvousHandler ------------------------------------------------------------

    def next_rendezvous(self) -> RendezvousInfo:
        """Joins the next round; blocks until it formed (at most the join timeout). Raises
        ``RendezvousClosedError`` when the run is closed, ``RendezvousTimeoutError`` after the
        join timeout, ``RendezvousConnectionError`` when the store is lost or ``shutdown()``
        was called meanwhile (from another thread)."""

    def get_backend(self) -> str:
        """The backend's canonical name (``registry.py``); no I/O."""

    def get_run_id(self) -> str:
        """The run id; no I/O."""

    def is_closed(self) -> bool:
        """Whether the run is closed; one store read (``RendezvousConnectionError``)."""

    def set_closed(self) -> None:
        """Closes the run for every node (the restarts are spent); one store write."""

    def num_nodes_waiting(self) -> int:
        """Positive once the current round must be replaced; one store read at most."""

    def shutdown(self) -> bool:
        """Withdraws this node (its keys, its servers); may be called from another thread while
        ``next_rendezvous`` blocks, which then raises. False when the store was gone."""

    @property
    def use_agent_store(self) -> bool:
        """Whether the workers' ``MASTER_ADDR:MASTER_PORT`` is the round's store."""

    # -- the agent's wait point and the end of a run ----------------------------------------

    @property
    def round(self) -> RoundState | None:
        """The current round's record (number, participants); None outside a round or when
        the backend keeps none. No I/O."""

    @property
    def hosts_store(self) -> bool:
        """Whether this node hosts a store others use (the rendezvous server or the current
        round's store): it must serve until the others are done. No I/O."""

    @property
    def store_moves(self) -> Sequence[HostRecord]:
        """The switches of the rendezvous store's host this node made (``failover.py``), oldest
        first; empty for a backend without failover. No I/O."""

    def end_round(self, reason: str) -> None:
        """Tells every participant at once that the current round is over (a worker failed
        here); no-op outside a round or when already ended. One store write."""

    def closed_reason(self) -> str | None:
        """Why the run was closed ("stopped by operator", "finished", ...), None when open or
        closed without a reason. At most one store read; raises like ``is_closed``."""

    def set_finished(self) -> None:
        """Closes the run as finished (this node's workers succeeded) unless it is closed
        already. One store write."""

    def publish_status(self, status: dict[str, object],
                       failure: dict[str, object] | None = None) -> None:
        """Writes this node's status record (and the job's last failure) for
        ``elasticstore status``; one or two store writes."""

    def watch_round(self) -> RoundWatchLike | None:
        """A watch on the current round's end, for a thread of its own (None outside a
        round); its ``wait`` blocks, its ``close`` ends it from any thread."""

    def serve_until_left(self, timeout: float, interrupted: Callable[[], bool],
                         on_wait: Callable[[list[str]], None]) -> list[str]:
        """The run closed and this node hosts the rendezvous store: serves until every other
        node left, at most ``timeout`` s or until ``interrupted()``; ``on_wait(others)`` once
        before it waits. Returns the nodes still there ([] at once when hosting nothing)."""

    def peers_done(self, info: RendezvousInfo, attempt: int) -> bool:
        """Whether another node of round ``info`` (the agents' attempt ``attempt``) finished:
        on a connection of its own with a short deadline (the round's store may have gone with
        its host); False when it cannot tell."""

    def member_lost(self) -> bool:
        """Whether a participant of the current round is gone (its liveness key vanished; on
        the native store that is at once when its process dies); one list call, False when
        it cannot tell. A peer node's death can reach a worker here (its collective's
        connection reset) before the round's watcher ended the round: that worker's failure
        is the peer's loss, not one of this node's."""

    def step_aside(self) -> None:
        """This node stays out of the rendezvous for now (its health check failed): leaves the
        current round and withdraws its liveness key, so the others neither wait for it to come
        back nor count it as waiting; the next ``next_rendezvous`` brings it back. A few store
        writes; nothing to do for a backend that keeps no liveness keys."""

    def peer_statuses(self) -> list[dict[str, object]]:
        """The other nodes' status records (``publish_status``) as they are now: one listing
        and one read per node; [] for a backend that keeps none. Raises like ``is_closed``."""

    def share_imports(self, names: Sequence[str]) -> bool:
        """Publishes the modules the job's workers import (what this node's fork server
        preloaded), for a node that joins later to preload before its first round: one store
        write where this node is its round's rank 0, else (and for a backend that keeps no such
        list) nothing. Whether it wrote."""

    def shared_imports(self) -> list[str]:
        """The list ``share_imports`` published ([] when none, or for a backend that keeps
        none); names, unchecked (the fork server checks each). One store read, on a connection
        of its own (another thread may wait in ``next_rendezvous``)."""


class PollWatch:
    """A round watch for a handler without one: asks ``num_nodes_waiting()`` every
    ``interval`` seconds."""

    def __init__(self, handler: RendezvousHandler, interval: float) -> None:
        self._handler, self._interval = handler, interval
        self._closed = threading.Event()

    def wait(self, timeout: float) -> bool:
        for _ in range(1 << 40):
            if self._closed.wait(min(self._interval, timeout)):
                return False
            if self._handler.num_nodes_waiting() > 0:
                return True
            timeout -= self._interval
            if timeout <= 0:
                return False
        return False

    def close(self) -> None:
        self._closed.set()


class BasicRendezvous:
    """A handler without elasticstore's parts, as an :class:`AgentRendezvous`: no round record,
    no status, nothing to serve; this node hosts the round's store when it has rank 0 (torch's
    rule); the round's end is polled (:class:`PollWatch`)."""

    def __init__(self, handler: RendezvousHandler, poll_interval: float) -> None:
        self._h, self._interval = handler, poll_interval
        self._rank: int | None = None

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._h.next_rendezvous()
        self._rank = info.rank
        return info

    def get_backend(self) -> str:
        return self._h.get_backend()

    def get_run_id(self) -> str:
        return self._h.get_run_id()

    def is_closed(self) -> bool:
        return self._h.is_closed()

    def set_closed(self) -> None:
        self._h.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._h.num_nodes_waiting()

    def shutdown(self) -> bool:
        return self._h.shutdown()

    @property
    def use_agent_store(self) -> bool:
        return bool(self._h.use_agent_store)

    @property
    def round(self) -> RoundState | None:
        return None

    @property
    def hosts_store(self) -> bool:
        return self._rank == 0

    @property
    def store_moves(self) -> Sequence[HostRecord]:
        return ()

    def end_round(self, reason: str) -> None:
        return None

    def closed_reason(self) -> str | None:
        return None

    def set_finished(self) -> None:
        return None

    def publish_status(self, status: dict[str, object],
                       failure: dict[str, object] | None = None) -> None:
        return None

    def watch_round(self) -> RoundWatchLike | None:
        return PollWatch(self._h, self._interval)

    def serve_until_left(self, timeout: float, interrupted: Callable[[], bool],
                         on_wait: Callable[[list[str]], None]) -> list[str]:
        return []

    def peers_done(self, info: RendezvousInfo, attempt: int) -> bool:
        return False

    def member_lost(self) -> bool:
        return False

    def step_aside(self) -> None:
        return None

    def peer_statuses(self) -> list[dict[str, object]]:
        return []

    def share_imports(self, names: Sequence[str]) -> bool:
        return False

    def shared_imports(self) -> list[str]:
        return []


def as_agent_rendezvous(handler: RendezvousHandler | AgentRendezvous,
                        poll_interval: float) -> AgentRendezvous:
    """``handler`` itself when it has every part of :class:`AgentRendezvous`, else adapted by
    :class:`BasicRendezvous` (decided once, here)."""
    if isinstance(handler, AgentRendezvous):
        return handler
    return BasicRendezvous(handler, poll_interval)
