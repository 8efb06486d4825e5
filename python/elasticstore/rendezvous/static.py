"""The static backend: fixed ranks for the legacy ``--node-rank/--master-addr/--master-port`` path.

``rank`` comes from the settings (torchrun adds it from ``--node-rank``); the world size is
``max_nodes`` (which must equal ``min_nodes``). Rank 0 hosts a native server at the endpoint (it
speaks torch's TCPStore protocol, so the workers' store is the agents' store, as in torch's static
rendezvous); the others connect to it. No membership changes: every ``next_rendezvous`` returns
the same ranks; each restart's workers use their own ``/worker/attempt_N`` prefix (torch's).
"""

from __future__ import annotations

from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)

from ..stores.native.token import resolve_token
from ..stores.native.server import StoreServer
from ..stores.native.store import Store
from .worker_store import local_addr
from .settings import RendezvousSettings

__all__ = ["StaticRendezvousHandler"]


class StaticRendezvousHandler(RendezvousHandler):
    def __init__(self, settings: RendezvousSettings) -> None:
        if settings.min_nodes != settings.max_nodes:
            raise ValueError(
                f"static rendezvous: nnodes must be fixed, got {settings.min_nodes}:{settings.max_nodes}"
            )
        if settings.rank is None or settings.rank >= settings.max_nodes:
            raise ValueError(
                f"static rendezvous: rdzv-conf rank={settings.rank}: need 0 <= rank < "
                f"{settings.max_nodes} (--node-rank)"
            )
        self._settings = settings
        self._closed = False
        self._server: StoreServer | None = None
        self._store: Store | None = None

    def get_backend(self) -> str:
        return "elasticstore-static"

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        s = self._settings
        if self._closed:
            raise RendezvousClosedError(f"rendezvous {s.run_id!r} is closed")
        host = s.address
        if self._store is None:
            timeout = timedelta(seconds=s.join_timeout)
            if s.rank == 0:
                self._server = StoreServer(host, s.port, token=s.store_token)
            self._store = Store(
                host, s.port, timeout=timeout, connect_timeout=timeout, token=s.store_token
            )
            if resolve_token(s.store_token):
                # The agents' store is the workers' (MASTER_ADDR/PORT): vouch for this node's
                # address so its workers' torch TCPStore clients are served under the token.
                self._store.allow_peers([local_addr(s)])
        assert s.rank is not None
        # MASTER_ADDR/MASTER_PORT as the user gave them (torch's static rendezvous does the same):
        # a script's own tcp://<master-addr>:<master-port> reaches this store.
        return RendezvousInfo(
            self._store, s.rank, s.max_nodes, RendezvousStoreInfo(s.host, s.port)
        )

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._settings.run_id

    def shutdown(self) -> bool:
        store, self._store = self._store, None
        server, self._server = self._server, None
        if store is not None:
            store.close()
        if server is not None:
            server.close()
        return True
