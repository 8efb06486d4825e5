"""``ElasticRendezvousHandler``: torch's ``RendezvousHandler`` over a :class:`StoreBackend`.

The executor of ``decisions``: a node writes its liveness key once, joins round T with one
session-bound key, and either becomes T's decider (one ``create``) or watches ``ctl/`` for the
round record. The decider watches the run's keys, feeds :func:`decisions.decide` and writes the
round once with compare-and-set. A participant watches its successor's liveness key (a ring:
O(1) per node) and signals ``ctl/restart/R`` when it vanishes, so ``num_nodes_waiting()`` turns
positive at once everywhere. Round R's rank 0 hosts a fresh worker store (a new native server,
so no key of an earlier round is visible) and publishes it under ``ctl/boot/R``
(``worker_store``). What an agent uses beyond torch's interface is in ``agent_side.py``.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import NoReturn

from torch.distributed import Store as TorchStore
from torch.distributed.elastic.rendezvous import (RendezvousClosedError, RendezvousConnectionError,
                                                  RendezvousHandler, RendezvousInfo,
                                                  RendezvousStoreInfo, RendezvousTimeoutError)

from ..errors import StoreNetworkError
from ..stores.native.server import StoreServer
from ..stores.native.store import Store
from . import decisions, takeover
from .agent_side import AgentSide
from .backend import StoreBackend
from .closing import RoundWatch, closed_error, closed_reason_of
from .executor import Decider, DeciderCheck, Heartbeat, RingWatcher, await_round
from .failover import HostRecord, endpoint_of
from .native import create_native_backend
from .settings import RendezvousSettings, parse_endpoint
from .state import Keys, NodeId, RoundState
from .worker_store import (RoundReplaced, await_boot, connect_worker_store, host_worker_store,
                           local_addr)

__all__ = ["ElasticRendezvousHandler", "RoundWatch", "native_handler"]

log = logging.getLogger(__name__)
# Local ids start at a random number: inside a PID namespace every agent is pid 1, and containers
# with host networking share the address; counting up keeps the handlers of one process apart.
_LOCAL_IDS = itertools.count(secrets.randbits(40) << 16)


class ElasticRendezvousHandler(AgentSide, RendezvousHandler):
    """See the module doc. Several handlers in one process are distinct nodes."""

    def __init__(self, backend: StoreBackend, settings: RendezvousSettings) -> None:
        self._backend = backend
        self._settings = settings
        self._keys = Keys(settings.run_id)
        self._addr = local_addr(settings)
        self._node = str(NodeId(self._addr, os.getpid(), next(_LOCAL_IDS)))
        self._round: RoundState | None = None
        self._alive = False
        self._ring: RingWatcher | None = None
        self._spare: StoreBackend | None = None  # the next ring watcher's connection, made early
        self._joined: str | None = None  # the join key of the last round joined (see _join)
        self._heartbeat: Heartbeat | None = None
        self._worker_server: StoreServer | None = None
        self._worker_store: Store | None = None
        self._stop_seen: str | None = None  # the run's closing reason, once a watch saw it
        self._joining = 0  # next_rendezvous calls in progress (another thread's, at shutdown)
        self._shut = False  # shutdown() was called: a join in progress gives up
        self._init_failover(backend)
        try:
            with self._guard():
                self._attach(backend)
                if self._fails_over and backend.server is not None:  # the first host: epoch 1
                    backend.create(self._keys.host, HostRecord(1, self._node, endpoint_of(
                        settings.address, settings.port), None, time.time()).to_json())
        except RendezvousConnectionError as exc:  # lost at once: look it up again, or raise
            takeover.lost_at_start(self, backend, exc)

    def _attach(self, backend: StoreBackend) -> None:
        """Uses ``backend``: this node's liveness key, the next ring watcher's connection."""
        self._backend = backend
        if backend.needs_heartbeat:
            # The liveness key is bound to the heartbeat's own connection and refreshed
            # every lease_ttl/3: a node silent for lease_ttl is timed out by its watcher.
            self._heartbeat = Heartbeat(backend, self._keys, self._node, self._addr,
                                        self._settings.lease_ttl / 3)
            self._alive = True
        else:
            self._ensure_alive()
        self._spare = backend.clone()
        self._watch_host(backend)

    # -- torch's interface ----------------------------------------------------------------------

    def get_backend(self) -> str:
        return self._backend.name

    @property
    def use_agent_store(self) -> bool:
        """True: the workers' ``MASTER_ADDR:MASTER_PORT`` is the round's store, the agents' too."""
        return True

    def get_run_id(self) -> str:
        return self._settings.run_id

    @property
    def node_id(self) -> str:
        return self._node

    def next_rendezvous(self) -> RendezvousInfo:
        self._joining += 1
        error: BaseException | None = None
        try:
            info = self._next_rendezvous()
            if not self._shut:
                return info
        except BaseException as exc:
            if not self._shut:
                raise
            error = exc
        finally:
            self._joining -= 1
        self._leave_round(withdraw=False)  # a round entered meanwhile: its store, its server
        raise RendezvousConnectionError(
            f"rendezvous {self._settings.run_id!r}: node {self._node} was shut down while "
            "joining") from error

    def _next_rendezvous(self) -> RendezvousInfo:
        for _ in range(64):  # a pass per switch of store host
            if (lost := self._take_loss()) is not None:
                takeover.take_over(self, lost)
            try:
                return self._join_next()
            except RendezvousTimeoutError as exc:
                self._close_without_quorum(exc)
                raise
            except RendezvousConnectionError:
                if self._lost is None:  # not a loss a survivor may take over
                    raise
        raise RendezvousConnectionError("rendezvous: the store's host kept being lost")

    def _join_next(self) -> RendezvousInfo:
        start = time.monotonic()
        deadline = start + self._settings.join_timeout
        with self._guard():
            self._leave_round()
            self._check_store()
            closed = self._backend.get(self._keys.closed)
            if closed is not None:
                self._closed_error(closed)
            self._joined_open = True  # ``stood_by``
            if self._heartbeat is not None:
                self._heartbeat.beat()  # back at once after a silence that got it deleted
            else:
                self._ensure_alive()
            current = self._read_round()
            target = current.round + 1 if current else 1
            for _ in range(100_000):  # each pass is a round formed or replaced
                state = self._join(target, deadline)
                if self._fails_over:  # what a new host would be seeded with (standbys too)
                    takeover.after_round(self, state)
                rank = state.rank_of(self._node)
                if rank is None:  # standby or too late: wait for the next round
                    target = state.round + 1
                    continue
                try:
                    info = self._enter(state, rank, deadline)
                except RoundReplaced:
                    target = state.round + 1
                    continue
                log.info("rendezvous %s round %d: node %s has rank %d of %d (%.3fs)",
                         self._settings.run_id, state.round, self._node, rank, state.world_size,
                         time.monotonic() - start)
                return info
        raise RendezvousTimeoutError("rendezvous: too many rounds replaced while joining")

    def is_closed(self) -> bool:
        with self._guard():
            return self._backend.get(self._keys.closed) is not None

    def set_closed(self) -> None:
        with self._guard():
            self._backend.set(self._keys.closed, b"1")

    def _closed_error(self, closed: bytes) -> NoReturn:
        reason = closed_reason_of(closed)
        if reason is not None:
            self._stop_seen = reason
        raise closed_error(reason, self._backend.name, self._backend.endpoint,
                           self._settings.run_id, self._settings.etcd_prefix)

    def num_nodes_waiting(self) -> int:
        """Positive as soon as the current round must be replaced: a participant was lost
        (its liveness key vanished) or a waiting node fits in. One read."""
        rnd = self._round
        if rnd is None:
            return 0
        try:
            if self._lost is None:
                with self._guard():
                    return decisions.waiting_count(self._backend.get(self._keys.restart(rnd.round)))
        except RendezvousConnectionError:
            if self._lost is None:
                raise
        return 1  # the store's host is lost: a new round on the next host

    def shutdown(self) -> bool:
        """Withdraws this node only (its keys go; the rendezvous stays open for the others).

        At once while another thread waits in ``next_rendezvous`` (an agent that got a signal):
        that wait blocks on this node's connection, so the connection is closed first, which
        ends the wait (``next_rendezvous`` raises) and, with the session, this node's
        session-bound keys; nothing is left to delete."""
        self._shut = True
        joining = self._joining > 0
        if joining:
            self._close_connections()
        try:
            try:
                self._leave_round(withdraw=not joining)
            finally:  # no thread of this node outlives it, whatever failed
                heartbeat, self._heartbeat = self._heartbeat, None
                if heartbeat is not None:
                    heartbeat.stop()  # its session ends: the liveness key goes
            if self._alive and heartbeat is None and not joining:
                self._backend.delete(self._keys.alive(self._node))
            self._alive = False
            return True
        except Exception as exc:  # the store may be gone with its host: nothing left to undo
            log.warning("rendezvous shutdown of %s: %s", self._node, exc)
            return False
        finally:
            self._close_connections()

    def step_aside(self) -> None:
        """Leaves the current round and withdraws this node's liveness key (native: deleted;
        etcd: its heartbeat stopped, whose session held it) until the next ``next_rendezvous``
        (``_ensure_alive``): the others' next round forms without it, as after a loss."""
        with self._guard():
            self._leave_round()
            heartbeat, self._heartbeat = self._heartbeat, None
            if heartbeat is not None:
                heartbeat.stop()
            elif self._alive:
                self._backend.delete(self._keys.alive(self._node))
            self._alive = False

    def _close_connections(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.close()
        self._stop_failover()
        self._backend.close()

    # -- joining ----------------------------------------------------------------------------------

    def _ensure_alive(self) -> None:
        """Writes this node's liveness key unless it is there: after a reconnect (native) or an
        expired lease (etcd: a partition that healed) the old one is gone and the node comes
        back with a new one. Written when the handler is made, so a round's decider sees it
        before the node joins (one event fewer per node in the join storm)."""
        if self._backend.needs_heartbeat:  # back after step_aside(): a heartbeat of its own
            self._heartbeat = Heartbeat(self._backend, self._keys, self._node, self._addr,
                                        self._settings.lease_ttl / 3)
            self._alive = True
            return
        key = self._keys.alive(self._node)
        if not self._alive or self._backend.get(key) is None:
            self._backend.set(key, self._addr, ephemeral=True)
            self._alive = True

    @contextmanager
    def _guard(self) -> Iterator[None]:
        backend = self._backend
        try:
            yield
        except StoreNetworkError as exc:
            error = RendezvousConnectionError(
                f"lost the rendezvous store at {backend.endpoint} ({backend.name}): {exc}")
            error.__cause__ = exc
            self._saw_loss(error, backend)  # ignored on a store this node switched from
            raise error from exc

    def _read_round(self) -> RoundState | None:
        data = self._backend.get(self._keys.round)
        return None if data is None else RoundState.from_json(data)

    def _join(self, target: int, deadline: float) -> RoundState:
        """Joins round ``target``; returns the first round record numbered ``target`` or later.
        The join key is deleted later (next join, ``_leave_round``): off the path to the rank,
        and nothing reads the join keys of a round that was written."""
        self._drop_join()
        join_key = self._joined = self._keys.join(target, self._node)
        self._backend.set(join_key, b"", ephemeral=True)
        try:
            for _ in range(100_000):
                if self._backend.create(self._keys.decider(target), self._node, ephemeral=True):
                    try:
                        return Decider(
                            backend=self._backend, keys=self._keys, settings=self._settings,
                            target=target, deadline=deadline, fence=self._fence,
                            on_deadline=lambda: self._check_closed_or_late(deadline, target),
                        ).run()
                    except RendezvousClosedError:  # closed while deciding: say why
                        if (closed := self._backend.get(self._keys.closed)) is not None:
                            self._closed_error(closed)
                        raise
                state = self._await_round(target, deadline)
                if state is not None:
                    return state
            raise RendezvousTimeoutError(f"round {target}: deciders kept failing")
        except BaseException:
            self._drop_join()
            raise

    def _drop_join(self) -> None:
        key, self._joined = self._joined, None
        if key is not None:
            self._backend.delete(key)

    def _await_round(self, target: int, deadline: float) -> RoundState | None:
        """Watches ``ctl/`` until round ``target`` (or later) is written; None when its decider
        left before writing it (the caller then tries to take its place)."""
        keys, backend = self._keys, self._backend
        check = (DeciderCheck(backend, keys, target, self._settings.lease_ttl, self._node)
                 if backend.needs_heartbeat else None)  # etcd: its lease ends a silent one
        try:
            return await_round(backend, keys, target, check,
                               lambda: self._check_closed_or_late(deadline, target),
                               deadline, self._closed_error)
        finally:
            if check is not None:
                check.release()

    def _check_closed_or_late(self, deadline: float, target: int) -> None:
        if time.monotonic() < deadline:
            return
        joined = [k.rsplit("/", 1)[1] for k in self._backend.list(self._keys.join_prefix(target))]
        alive = [k.rsplit("/", 1)[1] for k in self._backend.list(self._keys.alive_prefix)]
        s = self._settings
        raise RendezvousTimeoutError(decisions.late_message(
            s.run_id, target, s.join_timeout, s.min_nodes, s.max_nodes, joined, alive,
            self._read_round()))

    # -- a round ----------------------------------------------------------------------------------

    def _enter(self, state: RoundState, rank: int, deadline: float) -> RendezvousInfo:
        """Publishes (rank 0) or finds the round's worker store; starts watching the successor."""
        keys, backend = self._keys, self._backend
        self._round = state
        if state.world_size > 1:
            successor = state.participants[(rank + 1) % state.world_size]
            spare, self._spare = self._spare, None
            silent = self._settings.lease_ttl if backend.needs_heartbeat else None
            self._ring = RingWatcher(spare or backend.clone(), keys, state.round, successor, silent,
                                     partial(self._saw_loss, of=backend) if self._fails_over
                                     else None)
        if rank == 0:
            self._worker_server = host_worker_store(self._addr, state, self._settings.store_token)
            boot = self._worker_server.address
            backend.set(keys.boot(state.round), boot)
        else:
            boot = await_boot(backend, keys, state.round, deadline)
        host, port = parse_endpoint(boot)
        self._worker_store = connect_worker_store(backend, keys, state.round, host, port,
                                                  self._settings.store_timeout,
                                                  self._settings.store_token, deadline)
        store: TorchStore = self._worker_store
        return RendezvousInfo(
            store, rank, state.world_size, RendezvousStoreInfo(host.strip("[]"), port)
        )

    def _leave_round(self, withdraw: bool = True) -> None:
        """Stops the ring watcher, closes the round's worker store; then (``withdraw``) deletes
        the join key, which raises when the rendezvous store is gone (nothing else skipped)."""
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.stop()
        store, self._worker_store = self._worker_store, None
        if store is not None:
            store.close()
        server, self._worker_server = self._worker_server, None
        if server is not None:
            server.close()
        self._round = None
        if withdraw:
            self._drop_join()
        else:
            self._joined = None  # session-bound: gone with the closed connection


def native_handler(settings: RendezvousSettings) -> ElasticRendezvousHandler:
    """The ``elasticstore`` backend's handler (its row in ``registry.py``)."""
    return ElasticRendezvousHandler(create_native_backend(settings), settings)
