"""The native backend: the rendezvous on an elasticstore server.

The agent whose ``local_addr`` is the endpoint's host (``is_host`` decides when given, as in
torch's c10d backend) hosts the server in-process, unless a server already answers there; the
others (and every agent, with an external ``elasticstore-server``) connect to it. Liveness keys
are bound to the connection's session: a dead agent's keys vanish when its socket closes.
"""

from __future__ import annotations

import logging
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

from ..errors import StoreNetworkError
from ..stores.native.server import StoreServer
from ..stores.native.store import Store
from .backend import KeepFresh, StoreBackend
from .failover import endpoint_of, find_host
from .settings import RendezvousSettings
from .state import Keys

if TYPE_CHECKING:
    from .handler import ElasticRendezvousHandler

__all__ = ["NativeBackend", "connect_native_backend", "create_native_backend", "native_handler"]

log = logging.getLogger(__name__)

_PROBE = timedelta(seconds=0.5)
RECONNECT = timedelta(seconds=3)  # how long a call retries connecting to a lost server
# The same where a survivor takes over a lost host's store (rdzv-conf failover, the default):
# a server that is gone is taken for lost sooner, since the job goes on without it.
FAILOVER_RECONNECT = timedelta(seconds=1)


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
                           first_wait: float | None = None) -> NativeBackend:
    """A backend on the server at ``host:port``. The first connection may wait ``first_wait``
    seconds (default ``store_timeout``: for the host agent to start); once in, a lost server is
    reported within ``RECONNECT`` seconds (``FAILOVER_RECONNECT`` where a survivor may take
    over), never a hang."""
    timeout = timedelta(seconds=settings.store_timeout)
    first = timedelta(seconds=settings.store_timeout if first_wait is None else first_wait)
    reconnect = FAILOVER_RECONNECT if settings.failover else RECONNECT
    token = settings.store_token
    Store(host, port, timeout=timeout, connect_timeout=first, token=token).close()
    store = Store(host, port, timeout=timeout, connect_timeout=reconnect, token=token)
    return NativeBackend(store, endpoint_of(host, port), server)


def create_native_backend(settings: RendezvousSettings) -> NativeBackend:
    host = settings.address
    token = settings.store_token  # None: Store/StoreServer read the environment
    server: StoreServer | None = None
    if settings.failover and len(settings.endpoints) > 1:
        # A store that moved (its first host was lost): the newest host record among the
        # endpoints that answer; a node that starts late, or comes back, joins it there.
        moved = find_host(settings.member_endpoints(), Keys(settings.run_id), token)
        if moved is not None and moved.epoch > 1:
            log.info("the rendezvous store moved to %s (epoch %d)", moved.endpoint, moved.epoch)
            return connect_native_backend(settings, *moved.address)
    if _should_host(settings):
        try:
            Store(host, settings.port, timeout=_PROBE, connect_timeout=_PROBE, token=token).close()
            log.info("a rendezvous server already answers at %s", settings.endpoint)
        except StoreNetworkError:
            try:
                # Only agents (native clients) use it: with a token, torch's protocol, which
                # cannot prove it, is refused from every peer.
                server = StoreServer(host, settings.port, token=token, torch_protocol=False)
                log.info("hosting the rendezvous server at %s", server.address)
            except Exception as exc:  # bound by another agent meanwhile: use that one
                log.info("not hosting the rendezvous server at %s: %s", settings.endpoint, exc)
    try:
        backend = connect_native_backend(settings, host, settings.port, server)
    except BaseException:
        if server is not None:
            server.close()
        raise
    backend.endpoint = settings.endpoint
    return backend


def native_handler(settings: RendezvousSettings) -> ElasticRendezvousHandler:
    """The ``elasticstore`` backend's handler (its row in ``registry.py``)."""
    from .handler import ElasticRendezvousHandler

    return ElasticRendezvousHandler(create_native_backend(settings), settings)
