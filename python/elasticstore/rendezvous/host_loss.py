"""The handler's part that notices the loss of the rendezvous store's host and acts on it
(``failover.py``, ``takeover.py``): the probes of the host, a loss reported by any thread, the
check that a store is the run's, the fence before a round record, giving way to a newer store,
and closing a run that lost its quorum.

A loss is reported on a backend (the store it was seen on). Once this node switches stores,
what is reported on the store it left is stale and ignored: a watch of the old round, a probe
or a call in another thread may fail late, after the switch began or after a round formed on
the next host, and must not take that next host for lost too."""

from __future__ import annotations

import json
import logging
import threading
from contextlib import AbstractContextManager
from functools import partial

from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from ..errors import StoreNetworkError
from .backend import StoreBackend
from .closing import RoundWatch
from .failover import (Carried, HostRecord, find_standing, store_standing,
                       survivor_may_take_over)
from .follower import Follower, own_follower
from .hostprobe import HostProbe, NewerHostWatch, silent_after
from .settings import RendezvousSettings, parse_endpoint
from .state import Keys, RoundState
from .takeover import serve_early

__all__ = ["END_GRACE_S", "HostLoss"]

log = logging.getLogger(__name__)

END_GRACE_S = 0.5  # a round watch's time to return what the lost host sent before it left


class HostLoss:
    """Mixed into ``ElasticRendezvousHandler`` (through ``AgentSide``), whose state it reads."""

    _backend: StoreBackend
    _settings: RendezvousSettings
    _keys: Keys
    _node: str
    _addr: str
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

    def _init_failover(self, backend: StoreBackend) -> None:
        """The failover's state, and the follower at this node's endpoint (``follower.py``)."""
        self._carried = Carried()  # what this node would seed a new store host with
        self._lost = None  # the store's host was lost: switch at the next join
        self._left: StoreBackend | None = None  # the store being switched from (``_take_loss``)
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
                                    silent_after(s.store_timeout),
                                    partial(self._saw_loss, of=backend))
        elif len(s.endpoints) > 1:  # hosting: give way to a newer store?
            host, port = parse_endpoint(backend.endpoint)
            others = s.endpoints_but(host, port)
            self._newer = NewerHostWatch(others, self._keys, s.store_token, self._outranked,
                                         partial(self._yield_to, of=backend))

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

    def _reported_on_another(self, of: StoreBackend) -> bool:
        """Whether a loss reported on ``of`` is stale: ``of`` is not the store in use, or is
        the one being switched from. Called under ``_loss_lock``."""
        if of is self._backend and of is not self._left:
            return False
        log.debug("rendezvous %s: a loss reported on %s, a store this node switched from, is "
                  "ignored", self._settings.run_id, of.endpoint)
        return True

    def _take_loss(self) -> BaseException | None:
        """The loss to act on before the next join (None: none), taken: from here on, what is
        reported on the store in use is stale (``takeover.take_over`` moves to another)."""
        with self._loss_lock:
            lost, self._lost = self._lost, None
            if lost is not None:
                self._left = self._backend
            return lost

    def _saw_loss(self, error: BaseException, of: StoreBackend) -> None:
        """A store call, the round watch, a ring watcher or the host probe (any thread) found
        the store gone: once a survivor may take it over, the first candidate serves the next
        epoch at once (``takeover.serve_early``: not after its agent stopped its workers), the
        round is over (its watch ends, after handing over what it already received: a stop the
        host wrote before it left), and the next join switches without waiting on the lost host
        again. ``of``: the store the loss was seen on (a stale report is ignored)."""
        with self._loss_lock:
            if (self._lost is not None or self._shut or self._reported_on_another(of)
                    or not self._may_fail_over(error)):
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
        self._saw_loss(error, b)
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
        self._yield_to(found.record, b)
        raise RendezvousConnectionError(
            f"rendezvous {s.run_id!r}: {found.record.endpoint} serves a newer store of the run "
            f"(round {found.round}, epoch {found.record.epoch}): no round is formed here")

    def _store_round(self) -> int:
        """The number of the round record on this node's store (0: none)."""
        data = self._backend.store.try_get(self._keys.round)
        state = RoundState.from_json(data) if data is not None else None
        return state.round if state is not None else 0

    def _own_round(self) -> int | None:
        """``_store_round`` read on a short connection of its own (``failover.PROBE``), not on
        the shared client: a blocking call of the rendezvous thread holds that one (a decider's
        watch, up to ``join_timeout``), and the newer-host watch waited for it, so a host back
        from a stop sat out its join alone on its own store. None: the store does not answer."""
        host, port = parse_endpoint(self._backend.endpoint)
        found = store_standing(host.strip("[]"), port, self._keys, self._settings.store_token)
        return found.round if found is not None else None

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
        here = self._own_round()
        if here is None:
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

    def _yield_to(self, record: HostRecord, of: StoreBackend) -> None:
        """Gives this node's store up for ``record``'s: its round ends, its server closes (its
        members switch too: they find ``record``'s store before serving), and the next join
        joins ``record``'s store as a member (``takeover.take_over``). ``of``: this node's
        store that ``record``'s outranks (none but the one in use is given up)."""
        with self._loss_lock:
            if self._lost is not None or self._shut or self._reported_on_another(of):
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

