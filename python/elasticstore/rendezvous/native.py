"""The native backend: the rendezvous on an elasticstore server.

The agent whose ``local_addr`` is the endpoint's host (``is_host`` decides when given, as in
torch's c10d backend) hosts the server in-process, unless a server already answers there; the
others (and every agent, with an external ``elasticstore-server``) connect to it. Liveness keys
are bound to the connection's session: a dead agent's keys vanish when its socket closes.
"""

from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta

from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from ..errors import StoreNetworkError, StoreTimeoutError
from ..stores.native.server import StoreServer
from ..stores.native.store import Store
from .backend import KeepFresh, StoreBackend
from .failover import HostRecord, endpoint_of, listening, read_host, survivor_may_take_over
from .follower import survey
from .settings import RendezvousSettings
from .state import Keys

__all__ = ["NativeBackend", "connect_native_backend", "create_native_backend"]

log = logging.getLogger(__name__)

_PROBE = timedelta(seconds=0.5)
RECONNECT = timedelta(seconds=3)  # how long a call retries connecting to a lost server
# The same where a survivor takes over a lost host's store (rdzv-conf failover, the default):
# a server that is gone is taken for lost sooner, since the job goes on without it.
FAILOVER_RECONNECT = timedelta(seconds=1)
FIND_PERIOD = 0.5  # seconds between two looks for a run's next host (``_find_run``)


class NativeBackend(StoreBackend[Store]):
    name = "elasticstore"
    needs_heartbeat = True  # the server keeps a silent session open (no lease on sessions)

    def __init__(
        self, store: Store, endpoint: str, server: StoreServer | None = None
    ) -> None:
        super().__init__(store, endpoint)
        self.server = server

    def revision(self) -> int:
        return int(self.store.stats()["revision"])

    def clone(self) -> NativeBackend:
        return NativeBackend(self.store.clone(), self.endpoint)

    def keep_fresh(self, key: str, value: str, period: float, presence: str) -> KeepFresh:
        return self.store.keep_fresh(key, value, period, presence)

    def close(self) -> None:
        try:
            self.store.close()
        finally:
            if self.server is not None:
                self.server.close()


def _should_host(settings: RendezvousSettings) -> bool:
    if settings.is_host is not None:
        return settings.is_host
    try:
        host = settings.address
        if settings.local_address is not None:
            return settings.local_address == host
        # No local address given: host when the endpoint is an address of this machine (as
        # torch's c10d backend does; ``localhost`` included). Several agents of one machine
        # then race: one binds, the others find its server answering.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
        return True
    except OSError:
        return False


def connect_native_backend(settings: RendezvousSettings, host: str, port: int,
                           server: StoreServer | None = None,
                           first_wait: float | None = None,
                           reconnect: timedelta | None = None,
                           expect: HostRecord | None = None) -> NativeBackend:
    """A backend on the server at ``host:port``. The first connection may wait ``first_wait``
    seconds (default ``store_timeout``: for the host agent to start); once in, a lost server is
    reported within ``reconnect``, never a hang. By default ``FAILOVER_RECONNECT`` where a
    survivor may take over from the start (failover among several endpoints), else ``RECONNECT``:
    at one endpoint a survivor may take over only once it carries a round and the host record
    (``takeover.after_round`` shortens it then; a switch of host passes ``FAILOVER_RECONNECT``).
    ``expect``: the host record that named this store; raises ``StoreNetworkError`` unless the
    server shows it (or a newer epoch): a host that gave its store up since the look-up leaves
    a follower at its address (``follower.py``), whose empty store a node joining it would take
    for the run's and start the run afresh in."""
    timeout = timedelta(seconds=settings.store_timeout)
    first = timedelta(seconds=settings.store_timeout if first_wait is None else first_wait)
    if reconnect is None:
        takes_over = survivor_may_take_over(settings, None)
        reconnect = FAILOVER_RECONNECT if takes_over else RECONNECT
    token = settings.store_token
    with Store(host, port, timeout=first if expect else timeout, connect_timeout=first,
               token=token) as probe:
        if expect is not None:
            try:
                shown = read_host(probe, Keys(settings.run_id))
            except StoreTimeoutError as exc:  # accepted, no answer: as a failed connect
                raise StoreNetworkError(f"{endpoint_of(host, port)}: {exc}") from exc
            if shown is None or shown.epoch < expect.epoch:
                raise StoreNetworkError(
                    f"{endpoint_of(host, port)} no longer serves the run's store (looked up: "
                    f"{expect.endpoint}, epoch {expect.epoch}; it shows "
                    f"{'no host record' if shown is None else f'epoch {shown.epoch}'})")
    store = Store(host, port, timeout=timeout, connect_timeout=reconnect, token=token)
    return NativeBackend(store, endpoint_of(host, port), server)


def _find_run(settings: RendezvousSettings) -> HostRecord | None:
    """Where a node that starts (late, or the old host back) joins a run whose store moved: the
    newest host record served among the endpoints, when it is newer than epoch 1. It waits (up
    to ``join_timeout``) instead of hosting a fresh epoch 1 beside the run while the run may be
    alive without a store it can reach: a follower (``follower.py``) holds a copy of a host
    record newer than every served one (the host lost, the next one not serving yet), or an
    endpoint accepts connections but does not answer (a node stopped or frozen: a partition, a
    paused VM; its run may be alive). None: no store moved and nothing says a run is alive (the
    first entry's node hosts, as before); also once a silent endpoint stayed silent for
    ``join_timeout`` (a stuck process that is no node of the run must not block a new job)."""
    keys, token, endpoints = Keys(settings.run_id), settings.store_token, settings.member_endpoints()
    own = (settings.local_address, settings.port)
    deadline = time.monotonic() + settings.join_timeout
    told: set[str] = set()
    for _ in range(1 << 20):
        found = survey([e for e in endpoints if e != own], keys, token)
        served, copy = found.served, found.copy
        if served is not None and served.epoch > 1:
            return served
        alive = copy is not None and (served is None or served.epoch < copy.epoch)
        if not alive and not found.silent:
            return None
        if alive and "copy" not in told:
            told.add("copy")
            log.warning("rendezvous %s: the run is alive (a follower knows host %s, epoch %d) but "
                        "no store serves it: waiting for the next host", settings.run_id,
                        copy.endpoint, copy.epoch)  # type: ignore[union-attr]
        elif not alive and "silent" not in told:
            told.add("silent")
            log.warning("rendezvous %s: %s accept(s) connections but do(es) not answer (stopped or "
                        "cut off nodes of a running job?): waiting up to join_timeout %gs before "
                        "hosting the run", settings.run_id, ", ".join(found.silent),
                        settings.join_timeout)
        if time.monotonic() >= deadline:
            if not alive:
                log.warning("rendezvous %s: %s still silent after %gs: hosting the run",
                            settings.run_id, ", ".join(found.silent), settings.join_timeout)
                return None
            raise RendezvousConnectionError(
                f"rendezvous {settings.run_id!r}: the run is alive (its nodes know host "
                f"{copy.endpoint}, epoch {copy.epoch}) but no node served its store within "  # type: ignore[union-attr]
                f"join_timeout {settings.join_timeout:g}s among {', '.join(settings.endpoints)}")
        time.sleep(FIND_PERIOD)
    return None


def _join_listed(settings: RendezvousSettings) -> NativeBackend:
    """A node that does not host, given several endpoints: the store that moved (``_find_run``)
    or the first entry's (``_run_store``)."""
    backend = _run_store(settings, first_entry=True)
    assert backend is not None
    return backend


def _run_store(settings: RendezvousSettings, first_entry: bool) -> NativeBackend | None:
    """A backend on the store that moved (``_find_run``); where none moved, on the first
    entry's store (``first_entry``), or None (the first entry's node, which then hosts). When
    that store does not answer (its host stopped or lost since the look-up, or not started yet),
    it looks again until ``join_timeout``, as the others may be switching."""
    deadline = time.monotonic() + settings.join_timeout
    for _ in range(1 << 20):
        moved = _find_run(settings)
        if moved is None and not first_entry:
            return None
        host, port = moved.address if moved is not None else (settings.address, settings.port)
        wait = max(0.5, min(settings.store_timeout, deadline - time.monotonic()))
        try:
            backend = connect_native_backend(settings, host, port, first_wait=wait,
                                             expect=moved)
        except StoreNetworkError as exc:
            if time.monotonic() >= deadline:
                raise RendezvousConnectionError(
                    f"rendezvous {settings.run_id!r}: no store of the run answered among "
                    f"{', '.join(settings.endpoints)} within join_timeout "
                    f"{settings.join_timeout:g}s: {exc}") from exc
            log.info("no store at %s:%d yet (%s): looking again", host, port, exc)
            continue
        if moved is None:
            backend.endpoint = settings.endpoint
        else:
            log.info("the rendezvous store moved to %s (epoch %d)", moved.endpoint, moved.epoch)
        return backend
    raise RendezvousConnectionError(f"rendezvous {settings.run_id!r}: no store found")


def _store_answers(host: str, port: int, token: str | None) -> bool:
    """Whether a store answers at ``host:port`` within ``_PROBE``. Nothing listening there is the
    usual case (this node starts the run): one plain connect is refused at once, where a store
    client would retry the refused connect for its whole connect timeout."""
    if not listening(host, port, _PROBE.total_seconds()):
        return False
    try:
        Store(host, port, timeout=_PROBE, connect_timeout=_PROBE, token=token).close()
    except StoreNetworkError:
        return False
    return True


def create_native_backend(settings: RendezvousSettings) -> NativeBackend:
    start = time.monotonic()
    host = settings.address  # a name that resolves late is waited for (resolve.py)
    token = settings.store_token  # None: Store/StoreServer read the environment
    server: StoreServer | None = None
    if settings.failover and len(settings.endpoints) > 1 and not _should_host(settings):
        return _join_listed(settings)
    if settings.failover and len(settings.endpoints) > 1:
        moved = _run_store(settings, first_entry=False)
        if moved is not None:
            return moved
    if _should_host(settings):
        if _store_answers(host, settings.port, token):
            log.info("a rendezvous server already answers at %s", settings.endpoint)
        else:
            try:
                # Only agents (native clients) use it: with a token, torch's protocol, which
                # cannot prove it, is refused from every peer.
                server = StoreServer(host, settings.port, token=token, torch_protocol=False)
                log.info("hosting the rendezvous server at %s", server.address)
            except Exception as exc:  # bound by another agent meanwhile: use that one
                log.info("not hosting the rendezvous server at %s: %s", settings.endpoint, exc)
    # A node that does not host waits for the host's server up to join_timeout (at least
    # store_timeout): pods start in any order, the host's perhaps minutes later (image pulls).
    wait = None if server is not None else max(
        settings.store_timeout, settings.join_timeout - (time.monotonic() - start))
    try:
        backend = connect_native_backend(settings, host, settings.port, server, first_wait=wait)
    except BaseException:
        if server is not None:
            server.close()
        raise
    backend.endpoint = settings.endpoint
    return backend
