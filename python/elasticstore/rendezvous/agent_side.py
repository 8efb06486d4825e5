"""The handler's parts for an elastic agent, beyond torch's interface (``api.AgentRendezvous``):
the round's end as a watch, ending a round for everyone, the closing reason, the status record,
and the end of a run (finished; serving until the others left or finished)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousInfo

from ..errors import StoreNetworkError
from ..stores.native.server import StoreServer
from .backend import StoreBackend
from .closing import FINISHED, EndedWatch, RoundWatch, closed_reason_of, wait_alone
from .failover import Carried, HostRecord, find_standing, survivor_may_take_over
from .follower import Follower, own_follower
from .hostprobe import HostProbe, NewerHostWatch, silent_after
from .settings import RendezvousSettings, parse_endpoint
from .takeover import serve_early
from .state import Keys, RoundState
from .worker_store import peer_finished

__all__ = ["AgentSide"]

log = logging.getLogger(__name__)

END_GRACE_S = 0.5  # a round watch's time to return what the lost host sent before it left


class AgentSide:
    """Mixed into ``ElasticRendezvousHandler``, whose state it reads."""

    _backend: StoreBackend
    _settings: RendezvousSettings
    _keys: Keys
    _node: str
    _addr: str
    _round: RoundState | None
    _worker_server: StoreServer | None
    _stop_seen: str | None
    _carried: Carried
    _moves: list[HostRecord]
    _lost: BaseException | None
    _shut: bool
    _alive: bool
    _loss_lock: threading.Lock
    _watch: RoundWatch | None  # the last round watch made (ended when the host is lost)
    _superseded: HostRecord | None  # a store that outranks this node's (``_yield_to``)
    _seeded_round: int | None  # the round this node's store was seeded with (it took over)

    def _guard(self) -> AbstractContextManager[None]:
        raise NotImplementedError

    # -- failover of the store's host (failover.py, takeover.py) -------------------------------

    def _init_failover(self, backend: StoreBackend) -> None:
        """The failover's state, and the follower at this node's endpoint (``follower.py``)."""
        self._carried = Carried()  # what this node would seed a new store host with
        self._lost = None  # the store's host was lost: switch at the next join
        self._loss_settled = threading.Event()  # set: the round watch had its last word
        self._loss_settled.set()
        self._moves = []  # the switches of store host this node made
        self._loss_lock = threading.Lock()
        self._watch = None
        self._probe: HostProbe | None = None  # the store host's liveness probe (hostprobe.py)
        self._early: threading.Thread | None = None  # serving the next epoch (serve_early)
        self._early_backend: StoreBackend | None = None
        self._newer: NewerHostWatch | None = None  # a host's look for a store outranking its own
        self._superseded = None
        self._seeded_round = None
        self._joined_open = False  # this node joined while the run was open (``stood_by``)
        self._follower: Follower | None = own_follower(
            self._settings, self._addr, self._keys, self._node,
            backend.server is not None) if self._fails_over else None

    def _watch_host(self, backend: StoreBackend) -> None:
        """On ``backend`` (attached): the probe of its host (``hostprobe.HostProbe``), or, where
        this node hosts it, the look for a store that outranks it (``NewerHostWatch``)."""
        if not self._fails_over:
            return
        s = self._settings
        if backend.server is None:  # a silent host noticed in seconds
            if self._follower is None:  # it hosted (its follower became the store) and gave way
                self._follower = own_follower(s, self._addr, self._keys, self._node, False)
            host, port = parse_endpoint(backend.endpoint)
            self._probe = HostProbe(host.strip("[]"), port, s.store_token,
                                    silent_after(s.store_timeout), self._saw_loss)
        elif len(s.endpoints) > 1:  # hosting: give way to a newer store?
            host, port = parse_endpoint(backend.endpoint)
            others = s.endpoints_but(host, port)
            self._newer = NewerHostWatch(others, self._keys, s.store_token, self._outranked,
                                         self._yield_to)

    def _stop_failover(self) -> None:
        """Stops the probes and closes the follower and a store served early (at shutdown)."""
        serving = self._early
        if serving is not None:  # a store being served at once: closed below, not leaked
            serving.join(10.0)
        probe, newer, follower, early = self._probe, self._newer, self._follower, self._early_backend
        self._probe, self._newer, self._follower, self._early_backend = None, None, None, None
        for watcher in (probe, newer):
            if watcher is not None:
                watcher.stop()
        for part in (follower, early):
            if part is not None:
                part.close()

    @property
    def _fails_over(self) -> bool:
        """A survivor takes over this run's store when its host is lost."""
        return self._settings.failover and self._backend.name == "elasticstore"

    def _may_fail_over(self, exc: BaseException) -> bool:
        """Whether ``exc`` lost a store a survivor may take over: agent-hosted (a host record
        was read) or looked up among several endpoints, hosted elsewhere than here, and this
        node is in the rendezvous (not stepped aside: a node out of it, e.g. unhealthy, may
        have missed that the run finished and its host left), and the run is not closed (a node
        back from a SIGSTOP after the job finished must not host it again)."""
        return (self._fails_over and not self._shut and self._alive and self._backend.server is None
                and self._stop_seen is None and self._carried.closed is None  # not a closed run
                and survivor_may_take_over(self._settings, self._carried)
                and isinstance(exc.__cause__ or exc, StoreNetworkError))

    def _saw_loss(self, error: BaseException) -> None:
        """A store call, the round watch, a ring watcher or the host probe (any thread) found
        the store gone: once a survivor may take it over, the first candidate serves the next
        epoch at once (``takeover.serve_early``: not after its agent stopped its workers), the
        round is over (its watch ends, after handing over what it already received: a stop the
        host wrote before it left), and the next join switches without waiting on the lost host
        again."""
        with self._loss_lock:
            if self._lost is not None or self._shut or not self._may_fail_over(error):
                return
            self._lost = error
            self._loss_settled.clear()
        try:
            serve_early(self)  # type: ignore[arg-type]  # the handler, which this is mixed into
        finally:
            watch = self._watch
            try:  # what the host sent before it left (a stop) is handed over first
                if watch is not None:
                    watch.end(grace=END_GRACE_S)
            finally:
                self._loss_settled.set()

    def _check_store(self) -> None:
        """Before a join, on an agent-hosted store of several endpoints that this node does not
        host: the store must hold the run's host record at the epoch this node last saw, or a
        newer one. A server that does not is not the run's store (a follower that a lost host's
        restarted node started at its address, reached by a new connection; a round formed
        there would be a fresh run beside the job): it is taken for a lost host."""
        seen, b = self._carried.host, self._backend
        if not self._fails_over or b.server is not None or seen is None:
            return
        record = HostRecord.from_json(b.store.try_get(self._keys.host))
        if record is not None and record.epoch >= seen.epoch:
            return
        cause = StoreNetworkError(f"{b.endpoint} holds no host record of the run at epoch "
                                  f">= {seen.epoch}: not the run's store")
        error = RendezvousConnectionError(f"rendezvous {self._settings.run_id!r}: {cause}")
        error.__cause__ = cause
        self._saw_loss(error)
        raise error

    def _fence(self) -> None:
        """Called by a decider on this node right before it writes a round record: on a store
        this node hosts, among several endpoints, no other endpoint may serve a newer store of
        the run (``failover.py``: a newer round, or the same round at a newer epoch). One does
        when this node was stopped or cut off while the others moved on; a round written here
        would repeat the number the newer store forms next (its seed is this store's last
        round). Gives this store up for the newer one (``_yield_to``) and raises
        ``RendezvousConnectionError`` then; costs one short probe per other endpoint."""
        b, s = self._backend, self._settings
        if not self._fails_over or b.server is None or len(s.endpoints) < 2:
            return
        mine = HostRecord.from_json(b.store.try_get(self._keys.host))
        host, port = parse_endpoint(b.endpoint)
        others = s.endpoints_but(host, port)
        found = find_standing(others, self._keys, s.store_token)
        if found is None or found.rank <= (self._store_round(), mine.epoch if mine else 1):
            return
        self._yield_to(found.record)
        raise RendezvousConnectionError(
            f"rendezvous {s.run_id!r}: {found.record.endpoint} serves a newer store of the run "
            f"(round {found.round}, epoch {found.record.epoch}): no round is formed here")

    def _store_round(self) -> int:
        """The number of the round record on this node's store (0: none)."""
        data = self._backend.store.try_get(self._keys.round)
        state = RoundState.from_json(data) if data is not None else None
        return state.round if state is not None else 0

    def _close_without_quorum(self, late: BaseException) -> None:
        """The first round on a store this node took over did not form within ``join_timeout``
        (short of the quorum: more than half of the last round's nodes lost at once, restarted
        ones being new members): closes the run there, so that the nodes waiting in it exit
        saying why instead of starting the run afresh (round 1 again, its records lost) once
        this node is gone. A majority on the other side of a partition trains on its own store,
        which this does not touch. Never raises."""
        seeded, backend = self._seeded_round, self._backend
        if seeded is None or backend.server is None or not self._fails_over:
            return
        try:
            data = backend.store.try_get(self._keys.round)
            state = RoundState.from_json(data) if data is not None else None
            if state is not None and state.round > seeded:
                return  # a round formed here since the switch: not a lost quorum
            reason = (f"the store's host was lost together with more than half of round "
                      f"{seeded}'s nodes and too few of them came back within join_timeout "
                      f"{self._settings.join_timeout:g}s to go on safely ({late})")
            record = json.dumps({"reason": reason[:2000]})
            backend.create(self._keys.closed, record)
            self._carried.closed = record.encode()
            log.warning("rendezvous %s: closed: %s", self._settings.run_id, reason)
        except Exception as exc:
            log.warning("rendezvous %s: closing the run failed: %s", self._settings.run_id, exc)

    def _outranked(self, other: HostRecord, other_round: int) -> bool:
        """Whether this node's store must give way to ``other`` (served, at round
        ``other_round``). Another epoch: when its store is newer (``failover.py``: a newer
        round, or the same round at a newer epoch: a majority moved on), not when it was
        seeded from an older round than this store formed since (a node that took this host
        for lost while it was stopped or cut off). The same epoch (two hosts of one epoch: a
        candidate passed over that served late): only while no round formed here since the
        switch, to a store that formed one, or else to the earlier candidate's."""
        mine = self._carried.host
        epoch = mine.epoch if mine is not None else 1
        if other.node == self._node:
            return False
        try:
            here = self._store_round()
        except Exception:
            return False  # this store does not answer: its loss is noticed elsewhere
        if other.epoch != epoch:
            return (other_round, other.epoch) > (here, epoch)
        seeded = self._seeded_round
        if seeded is None:  # the first host (epoch 1): no second host of its epoch exists
            return False
        if here > seeded:
            return False  # a round formed here: this store holds the majority
        if other_round > seeded:
            return True
        rnd = self._carried.round
        order = [*rnd.participants, *rnd.standby] if rnd is not None else []
        return (other.node in order and self._node in order
                and order.index(other.node) < order.index(self._node))

    def _yield_to(self, record: HostRecord) -> None:
        """Gives this node's store up for ``record``'s: its round ends, its server closes (its
        members switch too: they find ``record``'s store before serving), and the next join
        joins ``record``'s store as a member (``takeover.take_over``)."""
        with self._loss_lock:
            if self._lost is not None or self._shut:
                return
            self._superseded = record
            self._lost = RendezvousConnectionError(
                f"rendezvous {self._settings.run_id!r}: {record.endpoint} serves the run's store "
                f"(epoch {record.epoch}), which outranks this node's")
        log.warning("rendezvous %s: %s serves the store (epoch %d): giving this node's up and "
                    "joining it", self._settings.run_id, record.endpoint, record.epoch)
        watch = self._watch
        if watch is not None:
            watch.end()
        server = self._backend.server
        if server is not None:
            server.close()

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
                        self._saw_loss if self._fails_over else None)
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

    def peers_done(self, info: RendezvousInfo, attempt: int) -> bool:
        """Whether another node of the round finished (``worker_store.peer_finished``)."""
        return peer_finished(info, attempt, self._settings.store_token)
