"""Addressing a job (backend, endpoint, run id, etcd options) and ``stop``.

``stop_job`` closes the rendezvous with the reason "stopped by operator" and ends the current
round (``ctl/restart/R``), so every agent's wait point wakes at once, stops its workers (SIGTERM,
then SIGKILL after its shutdown timeout), sees the closed rendezvous and exits 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ..rendezvous.settings import parse_endpoint
from ..rendezvous.state import Keys, RoundState

__all__ = ["STOP_REASON", "JobAddress", "JobNotFound", "connect", "stop_job"]

STOP_REASON = "stopped by operator"


class JobNotFound(RuntimeError):
    """No trace of the run at the endpoint."""


@dataclass(frozen=True)
class JobAddress:
    endpoint: str
    run_id: str
    backend: str = "elasticstore"  # or "etcd"
    timeout: float = 10.0
    etcd_prefix: str = "/elasticstore/rdzv"
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    token: str | None = field(default=None, repr=False)  # native: None reads the environment


def connect(addr: JobAddress) -> Any:
    """A store connection to the job's rendezvous store (``Store`` or ``EtcdStore``); raises
    the store's network error within ``addr.timeout`` when nothing answers."""
    wait = timedelta(seconds=addr.timeout)
    if addr.backend in ("etcd", "elasticstore-etcd"):
        from ..stores.etcd import EtcdStore

        return EtcdStore(addr.endpoint, prefix=addr.etcd_prefix, timeout=wait, connect_timeout=wait,
                         ca_cert=addr.cacert, cert=addr.cert, key=addr.key, user=addr.user,
                         password=addr.password)
    from ..stores.native.store import Store

    host, port = parse_endpoint(addr.endpoint)
    return Store(host.strip("[]"), port, timeout=wait, connect_timeout=wait, token=addr.token)


def read_round(store: Any, keys: Keys) -> RoundState | None:
    data = store.try_get(keys.round)
    return None if data is None else RoundState.from_json(data)


def exists(store: Any, keys: Keys) -> bool:
    return bool(store.try_get(keys.round) is not None or store.list_keys(keys.alive_prefix)
                or store.list_keys(keys.status_prefix) or store.try_get(keys.closed) is not None)


def stop_job(addr: JobAddress) -> RoundState | None:
    """Closes the job's rendezvous ("stopped by operator") and ends its current round; returns
    the round that was running (None when none had formed)."""
    keys = Keys(addr.run_id)
    store = connect(addr)
    try:
        if not exists(store, keys):
            raise JobNotFound(f"no job {addr.run_id!r} at {addr.endpoint}")
        store.set(keys.closed, json.dumps({"reason": STOP_REASON}))
        rnd = read_round(store, keys)
        if rnd is not None:
            store.compare_set_ex(keys.restart(rnd.round), b"",
                                 json.dumps({"reason": STOP_REASON, "closed": STOP_REASON}))
        return rnd
    finally:
        store.close()
