"""The rendezvous backends, one row each: every name a user may type for it, how to make its
handler, how the operator tools reach its store, and what torchrun's plugin entry points name.

Everything that accepts or names a backend reads this table: ``elasticstore-run --rdzv-backend``
(``run.py``), torchrun's ``torchrun.handlers`` entry points (``plugin.py``; ``pyproject.toml``
lists them as torch needs, and a test checks they match), ``elasticstore status/stop/forget
--rdzv-backend`` (``cli.py``, ``ops/``). A new backend is its module plus one row here (and its
entry point line in ``pyproject.toml``).

Handlers, stores and their modules are imported by name when a row is used: reading the table
imports no backend module (``native``, ``etcd``, ``static``) and no etcd client. It is not
torch-free: ``import elasticstore`` imports ``torch.distributed`` (``Store`` subclasses its
``Store``), and the ``elasticstore.rendezvous`` package imports the handler.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from .settings import DEFAULT_PORT, RendezvousSettings

__all__ = ["BACKENDS", "Backend", "StoreTarget", "backend", "job_backends", "names"]


class StoreTarget(Protocol):
    """Where an operator tool finds a job's rendezvous store (``ops.JobAddress``)."""

    @property
    def endpoint(self) -> str: ...

    @property
    def run_id(self) -> str: ...

    @property
    def timeout(self) -> float: ...

    @property
    def etcd_prefix(self) -> str: ...

    @property
    def cacert(self) -> str | None: ...

    @property
    def cert(self) -> str | None: ...

    @property
    def key(self) -> str | None: ...

    @property
    def user(self) -> str | None: ...

    @property
    def password(self) -> str | None: ...

    @property
    def token(self) -> str | None: ...


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Backend:
    """One backend. ``name``: canonical (torchrun's plugin name, the handler's
    ``get_backend()``); ``label``: the short name the launcher prints and keeps in its settings;
    ``aliases``: other names accepted for it; ``stands_in_for``: torch's backends it replaces
    (accepted with a notice saying so); ``factory``: ``module:function`` making the handler from
    the settings; ``connector``: ``module:function`` connecting the operator tools to its store
    (None: no job state to read there); ``store_kind``: ``native`` or ``etcd``;
    ``hosts_store``: an agent may host the rendezvous store in-process."""

    name: str
    label: str
    description: str
    factory: str
    plugin: str  # the attribute of ``elasticstore.rendezvous.plugin`` torchrun's entry point names
    aliases: tuple[str, ...] = ()
    stands_in_for: tuple[str, ...] = ()
    connector: str | None = None
    store_kind: str = "native"
    hosts_store: bool = True
    default_port: int = DEFAULT_PORT
    several_endpoints: bool = False  # --rdzv-endpoint may list members, comma-separated

    @property
    def names(self) -> tuple[str, ...]:
        """Every name accepted for this backend, canonical first."""
        return tuple(dict.fromkeys((self.name, self.label, *self.aliases, *self.stands_in_for)))

    def notice(self, typed: str) -> str | None:
        """What the launcher says when ``typed`` named one of torch's backends this replaces."""
        if typed in self.stands_in_for:
            return f"--rdzv-backend {typed}: running {self.description} instead"
        return None

    def settings(self, *, run_id: str, endpoint: str, min_nodes: int, max_nodes: int,
                 local_addr: str | None, config: Any) -> RendezvousSettings:
        """The rendezvous settings (``config``: the ``--rdzv-conf`` keys), parsed once; raises
        ``SettingsError`` naming the flag and key."""
        return RendezvousSettings.from_config(
            run_id=run_id, endpoint=endpoint, min_nodes=min_nodes, max_nodes=max_nodes,
            local_addr=local_addr, config=config, default_port=self.default_port,
            several=self.several_endpoints, any_port=self.hosts_store)

    def create_handler(self, settings: RendezvousSettings) -> Any:
        """A new handler for ``settings`` (imports torch and the backend's module)."""
        return _load(self.factory)(settings)

    def connect(self, target: StoreTarget) -> Any:
        """A connection to the job's rendezvous store for the operator tools; raises the
        store's network error within ``target.timeout`` when nothing answers."""
        if self.connector is None:
            raise ValueError(f"rendezvous backend {self.name}: no job state to read or change")
        return _load(self.connector)(target)


def connect_native(target: StoreTarget) -> Any:
    """The job's store; with several endpoints, the one whose host record is newest (the store
    may have moved after its host was lost: ``failover.py``), else the first."""
    from ..stores.native.store import Store
    from .failover import find_host
    from .settings import parse_endpoint
    from .state import Keys

    wait = timedelta(seconds=target.timeout)
    members = [parse_endpoint(e) for e in target.endpoint.split(",") if e.strip()]
    host, port = members[0] if members else parse_endpoint(target.endpoint)
    if len(members) > 1:
        moved = find_host([(h.strip("[]"), p) for h, p in members], Keys(target.run_id), target.token)
        if moved is not None:
            host, port = moved.address
    return Store(host.strip("[]"), port, timeout=wait, connect_timeout=wait, token=target.token)


def connect_etcd(target: StoreTarget) -> Any:
    from ..stores.etcd import EtcdStore

    wait = timedelta(seconds=target.timeout)
    return EtcdStore(target.endpoint, prefix=target.etcd_prefix, timeout=wait, connect_timeout=wait,
                     ca_cert=target.cacert, cert=target.cert, key=target.key, user=target.user,
                     password=target.password)


_HERE = __name__.rpartition(".")[0]

BACKENDS: tuple[Backend, ...] = (
    Backend(name="elasticstore", label="elasticstore", stands_in_for=("c10d",),
            description="elasticstore's native rendezvous",
            factory=f"{_HERE}.handler:native_handler", plugin="native_plugin",
            connector=f"{__name__}:connect_native", several_endpoints=True),
    Backend(name="elasticstore-etcd", label="etcd", stands_in_for=("etcd-v2",),
            description="elasticstore's rendezvous on etcd v3",
            factory=f"{_HERE}.etcd:etcd_handler", plugin="etcd_plugin",
            connector=f"{__name__}:connect_etcd", store_kind="etcd", hosts_store=False,
            default_port=2379, several_endpoints=True),
    Backend(name="elasticstore-static", label="static",
            description="fixed ranks, node rank 0 hosting the store at the endpoint",
            factory=f"{_HERE}.static:StaticRendezvousHandler", plugin="static_plugin"),
)

_BY_NAME = {n: row for row in BACKENDS for n in row.names}


def names() -> tuple[str, ...]:
    """Every backend name a user may type."""
    return tuple(_BY_NAME)


def job_backends() -> tuple[str, ...]:
    """The names the operator tools (``elasticstore status/stop/forget``) accept."""
    return tuple(n for n, row in _BY_NAME.items() if row.connector is not None)


def backend(name: str) -> Backend:
    """The row for ``name`` (any of its names); ``ValueError`` listing the names otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"{name!r}: expected one of {', '.join(_BY_NAME)}") from None
