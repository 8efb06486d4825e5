"""The etcd v3 backend: the rendezvous on :class:`~elasticstore.EtcdStore`.

Liveness keys are bound to the store's lease (``lease_ttl``, default 5 s, refreshed every
TTL/3): a dead or cut-off agent's keys vanish within the TTL. Several endpoints, TLS
(``cacert``, ``cert``, ``key``) and user/password come from the settings.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from .backend import StoreBackend
from .resolve import wait_for_name
from .settings import RendezvousSettings, parse_endpoint

if TYPE_CHECKING:  # at run time imported on first use (the elasticstore[etcd] extra)
    from ..stores.etcd import EtcdStore
    from .handler import ElasticRendezvousHandler

__all__ = ["EtcdBackend", "create_etcd_backend", "etcd_handler"]


class EtcdBackend(StoreBackend["EtcdStore"]):
    name = "elasticstore-etcd"

    def __init__(self, store: EtcdStore, endpoint: str, settings: RendezvousSettings) -> None:
        super().__init__(store, endpoint)
        self._settings = settings

    def revision(self) -> int:
        return self.store.revision()

    def delete(self, key: str) -> None:
        # One DeleteRange: the handler's deletes are idempotent and need no result, so not the
        # exactly-once read-modify-write of EtcdStore.delete_key (3 requests on a new lease).
        self.store.discard(key)

    def clone(self) -> EtcdBackend:
        return EtcdBackend(self.store.clone(), self.endpoint, self._settings)


def create_etcd_backend(settings: RendezvousSettings, endpoints: str | None = None) -> EtcdBackend:
    """The backend on ``endpoints`` (comma-separated members; default: the settings' members)."""
    from ..stores.etcd import EtcdStore  # noqa: F811 (the run-time import)

    endpoints = endpoints or ",".join(settings.endpoints) or settings.endpoint
    # A member's DNS name may resolve late (a StatefulSet's pods start in any order): wait,
    # until join_timeout, for one of them to resolve before the store's first connection.
    members = [e.strip().split("://", 1)[-1].rstrip("/") for e in endpoints.split(",")]
    wait_for_name([parse_endpoint(e)[0].strip("[]") for e in members if e],
                  settings.join_timeout)
    timeout = timedelta(seconds=settings.store_timeout)
    store = EtcdStore(
        endpoints,
        prefix=settings.etcd_prefix,
        timeout=timeout,
        lease_ttl=timedelta(seconds=settings.lease_ttl),
        ca_cert=settings.cacert,
        cert=settings.cert,
        key=settings.key,
        user=settings.user,
        password=settings.password,
    )
    return EtcdBackend(store, endpoints, settings)


def etcd_handler(settings: RendezvousSettings) -> ElasticRendezvousHandler:
    """The ``elasticstore-etcd`` backend's handler (its row in ``registry.py``)."""
    from .handler import ElasticRendezvousHandler

    return ElasticRendezvousHandler(create_etcd_backend(settings), settings)
