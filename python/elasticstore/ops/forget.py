"""``elasticstore forget``: removes every key of a finished or stopped run from its rendezvous
store, so that its run id can be used again (a closed run refuses every node that joins it).

A run's keys are those under ``rdzv/ID/`` (liveness, joins, round record, deciders, restarts,
worker store addresses, the closed marker) and ``status/ID/`` (the agents' status records, the
last failure). While an agent of the run lives (a liveness key exists) ``forget`` refuses, unless
``force``: those agents would go on in a rendezvous that no longer exists.

- native store: the keys are listed and deleted one by one (O(nodes + rounds) keys); an agent
  that joins between the check and the deletions is not seen: stop the run first.
- etcd: one transaction, "no liveness key under the run" then "delete both prefixes", so the
  check and the deletion cannot be torn apart.
"""

from __future__ import annotations

from typing import Any

from ..rendezvous import registry
from ..rendezvous.state import Keys
from .control import JobAddress, JobNotFound, connect, exists

__all__ = ["RunAlive", "forget_run"]

_NAMES_SHOWN = 8  # live agents named in the refusal


class RunAlive(RuntimeError):
    """An agent of the run is still alive: forgetting it was refused."""


def _alive_error(addr: JobAddress, alive: list[str]) -> RunAlive:
    names = ", ".join(n.rsplit("/", 1)[-1] for n in alive[:_NAMES_SHOWN])
    more = f" and {len(alive) - _NAMES_SHOWN} more" if len(alive) > _NAMES_SHOWN else ""
    return RunAlive(f"job {addr.run_id!r} at {addr.endpoint} still has {len(alive)} live "
                    f"agent(s) ({names}{more}): stop it first (elasticstore stop), or pass --force")


def _forget_native(store: Any, keys: Keys, addr: JobAddress, force: bool) -> int:
    alive = store.list_keys(keys.alive_prefix)
    if alive and not force:
        raise _alive_error(addr, alive)
    deleted = 0
    for prefix in (keys.base, keys.status_prefix):
        for key in store.list_keys(prefix):
            deleted += bool(store.delete_key(key))
    return deleted


def _forget_etcd(store: Any, keys: Keys, addr: JobAddress, force: bool) -> int:
    deleted: int | None = store.delete_prefixes(
        [keys.base, keys.status_prefix], unless_prefix=None if force else keys.alive_prefix)
    if deleted is None:
        raise _alive_error(addr, store.list_keys(keys.alive_prefix))
    return deleted


def forget_run(addr: JobAddress, force: bool = False) -> int:
    """Deletes every key of run ``addr.run_id``; returns how many. Raises ``JobNotFound`` when
    the store holds none, ``RunAlive`` while an agent of it lives (unless ``force``)."""
    keys = Keys(addr.run_id)
    store = connect(addr)
    try:
        if not exists(store, keys):
            raise JobNotFound(f"no job {addr.run_id!r} at {addr.endpoint}")
        if registry.backend(addr.backend).store_kind == "etcd":
            return _forget_etcd(store, keys, addr, force)
        return _forget_native(store, keys, addr, force)
    finally:
        store.close()
