"""The handler's parts for an elastic agent, beyond torch's interface (``api.AgentRendezvous``):
the round's end as a watch, ending a round for everyone, the closing reason, the status record,
and the end of a run (finished; serving until the others left or finished)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial

from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousInfo

from ..stores.native.server import StoreServer
from .closing import FINISHED, EndedWatch, RoundWatch, closed_reason_of, wait_alone
from .failover import HostRecord
from .host_loss import END_GRACE_S, HostLoss
from .records import parse_json
from .state import RoundState
from .worker_store import peer_finished

__all__ = ["AgentSide"]

log = logging.getLogger(__name__)

MAX_SHARED_IMPORTS = 4096  # module names in the run's list (``share_imports``)


class AgentSide(HostLoss):
    """Mixed into ``ElasticRendezvousHandler``, whose state it reads."""

    _round: RoundState | None
    _worker_server: StoreServer | None

    @property
    def round(self) -> RoundState | None:
        return self._round

    @property
    def stood_by(self) -> bool:
        """This node joined the rendezvous while the run was open (it waited for a place: a
        standby, or a node joining late), as opposed to one that found the run closed at once."""
        return self._joined_open

    @property
    def store_moves(self) -> tuple[HostRecord, ...]:
        """The switches of the rendezvous store's host this node made (``failover.py``)."""
        return tuple(self._moves)

    def set_finished(self) -> None:
        """Closes the run as finished (this node's workers succeeded) unless it is closed: its
        run id is refused until ``elasticstore forget``, and the others read that a peer finished."""
        with self._guard():
            self._backend.create(self._keys.closed, json.dumps({"reason": FINISHED}))

    def closed_reason(self) -> str | None:
        """Why the rendezvous was closed (``elasticstore stop`` writes "stopped by operator");
        None when it is open or closed without a reason. Once this node saw the run closed (in
        the event that ended its round), that reason, with no read: the store may be gone."""
        if self._lost is not None:  # the round watch's last word first (``_saw_loss``)
            self._loss_settled.wait(END_GRACE_S + 1.0)
        if self._stop_seen is not None:
            return self._stop_seen
        if self._lost is not None:  # the store's host is lost: what this node read last
            return closed_reason_of(self._carried.closed)
        with self._guard():
            data = self._backend.get(self._keys.closed)
        return closed_reason_of(data)

    def _saw_stop(self, reason: str) -> None:
        self._stop_seen = reason

    def publish_status(self, status: dict[str, object], failure: dict[str, object] | None = None) -> None:
        """Writes this node's status (JSON) for ``elasticstore status``, and the job's last
        failure when given. Outside the decider's prefix: no events for it."""
        if failure is not None:  # kept: a new store host is seeded with the last failure
            self._carried.failure = json.dumps(dict(failure, node=self._node)).encode()
        with self._guard():
            data = dict(status, node=self._node, addr=self._addr, updated=time.time())
            self._backend.set(self._keys.status_nodes + self._node, json.dumps(data))
            if failure is not None:
                self._backend.set(self._keys.failure, self._carried.failure or b"")

    def share_imports(self, names: Sequence[str]) -> bool:
        """Publishes the modules this node's fork server preloaded (at most
        ``MAX_SHARED_IMPORTS`` names), for a node that joins later to preload them before its
        first round (``agent/preload.py``): one write, outside the decider's prefix, by the
        current round's rank-0 node only (the others' calls do nothing). Whether it wrote."""
        rnd = self._round
        if rnd is None or rnd.rank_of(self._node) != 0:
            return False
        with self._guard():
            self._backend.set(self._keys.imports, json.dumps(list(names[:MAX_SHARED_IMPORTS])))
        return True

    def shared_imports(self) -> list[str]:
        """The run's list (``share_imports``): its strings, at most ``MAX_SHARED_IMPORTS`` ([]
        when there is none or it is not a JSON list; the fork server checks each name). On a
        connection of its own: called while another thread waits in ``next_rendezvous``; an
        error is raised as it is (a lost store is noticed where it matters, not here)."""
        backend = self._backend.clone()
        try:
            value = parse_json(backend.get(self._keys.imports))
        finally:
            backend.close()
        if not isinstance(value, list):
            return []
        return [name for name in value if isinstance(name, str)][:MAX_SHARED_IMPORTS]

    def peer_statuses(self) -> list[dict[str, object]]:
        """The other nodes' status records (JSON objects; a record that does not parse is left
        out): the hang verdict reads what the others' ranks do (``agent/progress.py``)."""
        if self._lost is not None:
            return []
        out: list[dict[str, object]] = []
        with self._guard():
            for key in self._backend.list(self._keys.status_nodes):
                if key.rsplit("/", 1)[-1] == self._node:
                    continue
                raw = self._backend.get(key)
                try:
                    record = json.loads(raw) if raw else None
                except ValueError:
                    continue
                if isinstance(record, dict):
                    out.append(record)
        return out

    def watch_round(self) -> RoundWatch | EndedWatch | None:
        """A watch on the current round's end (what ``num_nodes_waiting()`` reports), on a
        connection of its own; None outside a round."""
        rnd = self._round
        if rnd is None:
            return None
        try:
            if self._lost is None:
                with self._guard():
                    self._watch = watch = RoundWatch(
                        self._backend.clone(), self._keys.restart(rnd.round), self._saw_stop,
                        partial(self._saw_loss, of=self._backend) if self._fails_over else None)
                    watch.slice = min(watch.slice, self._settings.store_timeout)
                    if self._lost is not None:  # lost meanwhile (the host probe)
                        watch.end()
                    return watch
        except RendezvousConnectionError:
            if self._lost is None:
                raise
        return EndedWatch()  # the store's host is lost: the round is over

    def end_round(self, reason: str) -> None:
        """Tells every participant at once that the current round is over (e.g. a worker
        failed here); one event for the others' ``watch_round``, none when already ended."""
        rnd = self._round
        if rnd is not None:
            with self._guard():
                self._backend.create(self._keys.restart(rnd.round), json.dumps({"reason": reason}))

    def serve_until_left(self, timeout: float, interrupted: Callable[[], bool],
                         on_wait: Callable[[list[str]], None]) -> list[str]:
        """Hosting the rendezvous server: serves until every other node of the run left, at most
        ``timeout`` s or until ``interrupted()`` (see ``closing.wait_alone``); returns the nodes
        still there. [] at once when this node hosts no server."""
        if self._backend.server is None:
            return []
        with self._guard():
            backend = self._backend.clone()
            try:
                return wait_alone(backend, self._keys.alive_prefix, self._node, timeout,
                                  interrupted, on_wait)
            finally:
                backend.close()

    @property
    def hosts_store(self) -> bool:
        """This node hosts the rendezvous server or the current round's worker store."""
        return self._worker_server is not None or self._backend.server is not None

    def member_lost(self) -> bool:
        """A participant of the current round whose liveness key is gone (``api.py``)."""
        rnd = self._round
        if rnd is None or self._lost is not None:
            return False
        try:
            with self._guard():
                alive = {k.rsplit("/", 1)[-1] for k in self._backend.list(self._keys.alive_prefix)}
        except Exception:  # the store is lost: noticed and handled elsewhere
            return False
        return any(node not in alive for node in rnd.participants)

    def peers_done(self, info: RendezvousInfo, attempt: int) -> bool:
        """Whether another node of the round finished (``worker_store.peer_finished``)."""
        return peer_finished(info, attempt, self._settings.store_token)
