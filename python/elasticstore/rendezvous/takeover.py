"""A node's switch to the next host of a lost rendezvous store (``failover.py`` says why and how).

:func:`take_over` runs in ``next_rendezvous`` once a store call found the host gone: the node
drops everything bound to the dead store (its heartbeat, ring watcher, the round's worker store,
the spare connection), then walks the candidates (the same list on every survivor): it serves
itself when it is the candidate, else waits up to ``FAILOVER_WAIT`` for that candidate to serve
with the next epoch; a candidate that does not is taken for lost too.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from ..errors import AuthenticationError, StoreError, StoreNetworkError, StoreTimeoutError
from ..stores.native.server import StoreServer
from .backend import StoreBackend
from .executor import Heartbeat
from .failover import (FAILOVER_WAIT, Carried, HostRecord, addr_of, await_host, candidates,
                       endpoint_of, find_host, find_standing, read_host, seed,
                       survivor_may_take_over)
from .follower import Follower
from .hostprobe import HostProbe, NewerHostWatch
from .native import FAILOVER_RECONNECT, RECONNECT, NativeBackend, connect_native_backend
from .settings import RendezvousSettings
from .state import Keys, RoundState

__all__ = ["SwitchingNode", "after_round", "lost_at_start", "serve_early", "take_over"]


class SwitchingNode(Protocol):
    """What a switch of store host reads and changes of a node (``handler.py``'s handler): its
    identity, what it carries, and its connections to the store; nothing else of the handler."""

    _settings: RendezvousSettings
    _keys: Keys
    _node: str
    _addr: str
    _carried: Carried
    _backend: StoreBackend
    _spare: StoreBackend | None
    _heartbeat: Heartbeat | None
    _probe: HostProbe | None
    _newer: NewerHostWatch | None
    _superseded: HostRecord | None
    _seeded_round: int | None
    _follower: Follower | None
    _early: threading.Thread | None
    _early_backend: StoreBackend | None
    _alive: bool
    _moves: list[HostRecord]
    _lost: BaseException | None

    def _attach(self, backend: StoreBackend) -> None: ...

    def _leave_round(self, withdraw: bool = True) -> None: ...

log = logging.getLogger(__name__)


def take_over(handler: SwitchingNode, cause: BaseException) -> None:
    """Moves ``handler`` to the next host of its run's store; raises
    ``RendezvousConnectionError`` when no candidate serves it."""
    h = handler
    carried, settings = h._carried, h._settings
    old = carried.host
    newer, h._superseded = h._superseded, None
    if newer is not None:
        return _join_newer(h, newer)
    if old is None or carried.round is None:
        return _follow(h, cause)
    log.warning("rendezvous %s: lost the store's host %s (%s): the next host is chosen from "
                "round %d", settings.run_id, old.endpoint, cause, carried.round.round)
    _detach(h)
    early, h._early = h._early, None
    if early is not None:  # serving already (or about to): see serve_early
        early.join(2 * FAILOVER_WAIT)
    ready, h._early_backend = h._early_backend, None
    carried.lost.add(old.node)
    epoch, port = old.epoch + 1, old.address[1]
    tried: list[str] = []
    for node in candidates(carried):
        if node == h._node:
            backend = ready or _serve(h, epoch, port)
        else:
            backend = _reach(h, node, epoch, port)
        if backend is not None:
            break
        carried.lost.add(node)
        tried.append(node)
    else:
        raise RendezvousConnectionError(
            f"rendezvous {settings.run_id!r}: lost the store's host {old.endpoint} and no node "
            f"of round {carried.round.round} took it over (tried: {', '.join(tried) or 'none'}; "
            f"{FAILOVER_WAIT:g}s each)") from cause
    h._attach(backend)
    failure = carried.published_since()
    if failure is not None:  # published here during the last round: the others never read it
        backend.store.set(h._keys.failure, failure)
        carried.read_failure = failure
    record = read_host(backend.store, h._keys)
    if record is not None and record == old:  # taken for lost, but the others went on there
        log.warning("rendezvous %s: the store's host %s was not lost: it still serves epoch %d, "
                    "with a newer round than this node's", settings.run_id, record.endpoint,
                    record.epoch)
    elif record is not None:
        carried.host = record
        h._moves.append(record)
        log.warning("rendezvous %s: the store moved from %s to %s (epoch %d)", settings.run_id,
                    old.endpoint, record.endpoint, record.epoch)


def after_round(h: SwitchingNode, state: RoundState) -> None:
    """After entering round ``state``: what a new host would be seeded with (standbys too), and
    how long a lost connection to the store is retried. ``FAILOVER_RECONNECT`` (1 s) where a
    survivor takes the store over when its host is lost (``failover.survivor_may_take_over``);
    elsewhere (an external ``elasticstore-server`` at the only endpoint, no failover) a loss
    ends the run, so its connections are retried for ``RECONNECT`` (3 s), as at one endpoint
    before the first round, and a busy server or a starved agent thread is not taken for a lost
    store."""
    h._carried.refresh(h._backend.store, h._keys, state)
    if h._follower is not None:
        h._follower.record(h._carried)
    takes_over = survivor_may_take_over(h._settings, h._carried)
    budget = FAILOVER_RECONNECT if takes_over else RECONNECT
    for backend in (h._backend, h._spare):
        if isinstance(backend, NativeBackend) and backend.server is None \
                and backend.store.connect_timeout != budget:
            backend.store.set_connect_timeout(budget)


def lost_at_start(h: SwitchingNode, backend: StoreBackend,
                  error: RendezvousConnectionError) -> None:
    """The store went silent or away while a node that starts made its first calls on it (its
    liveness key, its spare connection): between its connect and these, the host was stopped
    (a frozen container, a supervisor's pause) or lost. A node that does not host a store it
    found among several endpoints is in no round yet: its first ``next_rendezvous`` looks the
    store up again (``_follow``, up to ``join_timeout``), as after any loss, instead of failing
    the agent's start. Any other error stands (raised again)."""
    s = h._settings
    if not (s.failover and backend.name == "elasticstore" and backend.server is None
            and len(s.endpoints) > 1 and isinstance(error.__cause__, StoreNetworkError)):
        raise error
    log.warning("rendezvous %s: %s; looking the store up again among %s at the first join",
                s.run_id, error, ", ".join(s.endpoints))
    if h._lost is None:
        h._lost = error


def _join_newer(h: SwitchingNode, record: HostRecord) -> None:
    """This node hosted a store that ``record``'s outranks (``AgentSide._outranked``): it joins
    that store as a member."""
    previous = h._carried.host
    _detach(h)
    try:
        backend = connect_native_backend(h._settings, *record.address, first_wait=FAILOVER_WAIT,
                                         reconnect=FAILOVER_RECONNECT, expect=record)
    except (StoreNetworkError, StoreTimeoutError) as exc:
        # Its store is given up (a newer one outranked it): this node cannot carry the run.
        raise RendezvousConnectionError(
            f"rendezvous {h._settings.run_id!r}: {record.endpoint} serves a newer store of the "
            f"run (epoch {record.epoch}) than this node's, and no longer serves it (looked for "
            f"{FAILOVER_WAIT:g}s): the job went on there without this node, and has finished "
            f"since or lost that host ({exc})") from exc
    h._attach(backend)
    if previous is not None:
        h._carried.lost.add(previous.node)
    h._carried.host = record
    h._moves.append(record)
    log.warning("rendezvous %s: the store moved from %s to %s (epoch %d)", h._settings.run_id,
                previous.endpoint if previous else "here", record.endpoint, record.epoch)


def _follow(h: SwitchingNode, cause: BaseException) -> None:
    """A node that saw no round (it waited for its first, or its last one) has no candidates
    of its own: it looks the store up among its ``--rdzv-endpoint`` entries for as long as it
    would wait to join (``join_timeout``, at least twice ``FAILOVER_WAIT``: the survivors'
    switch, or the old host restarted and hosting again), and joins the newest store served (a
    newer host, or the same one answering again after a silence). It is in no round: joining
    any store of the run cannot make a second group."""
    settings = h._settings
    _detach(h)
    start = time.monotonic()
    deadline = start + max(2 * FAILOVER_WAIT, settings.join_timeout)
    for _ in range(1 << 16):
        endpoints = settings.member_endpoints()
        found = find_host(endpoints, h._keys, settings.store_token)
        if found is not None:
            try:  # it may have gone silent again since it answered the look-up: look again
                h._attach(connect_native_backend(settings, *found.address,
                                                 first_wait=FAILOVER_WAIT,
                                                 reconnect=FAILOVER_RECONNECT, expect=found))
            except StoreNetworkError as exc:
                log.info("the store at %s did not answer (%s): looking again", found.endpoint, exc)
                found = None
        if found is not None:
            h._carried.host = found
            h._moves.append(found)
            log.warning("rendezvous %s: the store moved to %s (epoch %d)", settings.run_id,
                        found.endpoint, found.epoch)
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    raise RendezvousConnectionError(
        f"rendezvous {settings.run_id!r}: lost the rendezvous store and found no new host among "
        f"{', '.join(settings.endpoints)} within {time.monotonic() - start:.0f}s") from cause


def _detach(h: SwitchingNode) -> None:
    """Drops what is bound to the lost store; nothing here may wait on it."""
    try:
        h._leave_round(withdraw=False)
    except Exception as exc:  # the round's worker store may be gone too
        log.info("leaving the round after the store's loss: %s", exc)
    heartbeat, h._heartbeat = h._heartbeat, None
    if heartbeat is not None:
        heartbeat.stop()
    probe, h._probe = h._probe, None
    if probe is not None:
        probe.stop()
    newer, h._newer = h._newer, None
    if newer is not None:
        newer.stop()
    h._alive = False
    spare, h._spare = h._spare, None
    for conn in (spare, h._backend):
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass


def serve_early(h: SwitchingNode) -> None:
    """Called where the loss is noticed (any thread): when this node is the first candidate,
    it starts serving the next epoch now, in a thread of its own, so that stopping its workers
    (which may take up to ``--shutdown-timeout``) neither delays the new host nor gets it
    passed over; ``take_over`` then uses that store."""
    carried = h._carried
    old = carried.host
    if old is None or carried.round is None or h._early is not None:
        return
    first = candidates(carried)[:1]
    if first != [h._node]:
        return
    epoch, port = old.epoch + 1, old.address[1]

    def run() -> None:
        try:
            h._early_backend = _serve(h, epoch, port)
        except Exception as exc:
            log.warning("rendezvous %s: serving the store at once failed: %s", h._settings.run_id, exc)

    h._early = threading.Thread(target=run, name="rdzv-serve-next", daemon=True)
    h._early.start()


def _serve(h: SwitchingNode, epoch: int, port: int) -> StoreBackend | None:
    """This node is the candidate: a server on its own address at the store's port (its
    follower's, already listening, when it has one), seeded with the carried state; None when
    it cannot serve (the port is taken). Never a second host of one epoch: when another endpoint
    serves a store at least as new as this one would be (the carried round, ``epoch``; the order
    of ``failover.py``), this node joins it instead; a stale one it outranks by epoch too."""
    s = h._settings
    others = s.endpoints_but(h._addr, port)
    found = find_standing(others, h._keys, s.store_token)
    carried = h._carried.round.round if h._carried.round is not None else 0
    if found is not None and found.rank >= (carried, epoch):
        log.warning("rendezvous %s: %s serves the store already (round %d, epoch %d): joining it",
                    s.run_id, found.record.endpoint, found.round, found.record.epoch)
        return connect_native_backend(s, *found.record.address, first_wait=FAILOVER_WAIT,
                                      reconnect=FAILOVER_RECONNECT, expect=found.record)
    if found is not None and found.record.epoch >= epoch:
        # Seeded from an older round than this node took part in (its host took ours for lost
        # while it was stopped or cut off): never joined (its next round would repeat a number
        # and forget this node's rounds). This node serves a later epoch; that host gives way.
        log.warning("rendezvous %s: %s serves a stale store (round %d, epoch %d; this node was "
                    "in round %d): serving epoch %d instead", s.run_id, found.record.endpoint,
                    found.round, found.record.epoch, carried, found.record.epoch + 1)
        epoch = found.record.epoch + 1
    follower, h._follower = h._follower, None
    try:
        if follower is not None and follower.server.address == endpoint_of(h._addr, port):
            server = follower.promote()
        else:
            if follower is not None:
                follower.close()
            server = StoreServer(h._addr, port, token=s.store_token, torch_protocol=False)
    except Exception as exc:
        log.warning("cannot host the rendezvous store on %s: %s", endpoint_of(h._addr, port), exc)
        return None
    try:
        backend = connect_native_backend(s, h._addr, port, server, first_wait=FAILOVER_WAIT,
                                         reconnect=FAILOVER_RECONNECT)
        record = HostRecord(epoch, h._node, endpoint_of(h._addr, port), h._carried.host.endpoint
                            if h._carried.host else None, time.time())
        seed(backend.store, h._keys, h._carried, record)
        h._seeded_round = h._carried.round.round if h._carried.round is not None else None
        log.warning("rendezvous %s: this node hosts the store now, at %s (epoch %d)",
                    s.run_id, record.endpoint, epoch)
        return backend
    except BaseException:
        server.close()
        raise


def _reach(h: SwitchingNode, node: str, epoch: int, port: int) -> NativeBackend | None:
    """Waits up to ``FAILOVER_WAIT`` for ``node`` to serve the run's store with ``epoch``."""
    deadline = time.monotonic() + FAILOVER_WAIT
    addr = addr_of(node)
    try:
        backend = connect_native_backend(h._settings, addr, port, first_wait=FAILOVER_WAIT,
                                         reconnect=FAILOVER_RECONNECT)
    except AuthenticationError:
        raise
    except (StoreNetworkError, StoreTimeoutError, StoreError) as exc:
        log.warning("candidate %s did not serve the rendezvous store at %s: %s", node,
                    endpoint_of(addr, port), exc)
        return None
    try:
        if await_host(backend.store, h._keys, node, epoch, deadline) is not None:
            return backend
    except (StoreNetworkError, StoreTimeoutError):
        pass
    log.warning("candidate %s did not take over the rendezvous store within %gs", node, FAILOVER_WAIT)
    backend.close()
    return None
