"""The stores the conformance suite runs against: a small registry with capabilities.

A kind opens a fresh store for one test (:meth:`StoreKind.open`) and says what it lacks; a test
that needs a capability calls ``opened.require(capability)``, which skips with the kind's reason.
A later store plugs in by adding one :class:`StoreKind` to :data:`KINDS` (for example torch's
``TCPStore`` client against our server, or an etcd store).

Another process builds a client from ``opened.spec`` (plain JSON) with :func:`connect`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# Capabilities a kind may lack (the conformance tests require them by these names).
MULTIPROCESS = "clients in other processes"
ADD_WRONG_TYPE = "a usable connection after add() on a non-integer value"
QUEUES = "queue_push/queue_pop/queue_len"
LIST_KEYS = "list_keys"
BARRIER = "barrier"
WAKE_BY_ADD = "waiters woken by add"
BARRIER_WITHDRAWS = "a barrier that withdraws an arrival that timed out"
STRICT_ADD = "add() on strict decimal int64 counters, refusing overflow"
GET_WAITS_FOR_A_VALUE = "get() of a name only a queue holds waits for a value"

DEFAULT_TIMEOUT = timedelta(seconds=30)
TORCH_ADD = (
    "torch's stores parse a counter with std::stoll (' 7 ' is 7, '1_000' is 1) and wrap on "
    "overflow (2**63-1 + 1 is -2**63)"
)
TORCH_BARRIER = (
    "torch's client-side Store::barrier (an add, then a wait) counts an arrival that timed out"
)


@dataclass
class Opened:
    """One store for one test, and how to make more clients of the same data."""

    kind: StoreKind
    store: dist.Store
    new_client: Callable[[], dist.Store]  # another client in this process (own connection)
    spec: dict[str, Any] | None  # builds a client in another process; None without MULTIPROCESS
    server: Any = None  # an elasticstore.StoreServer when the kind runs one

    def require(self, capability: str) -> None:
        import pytest

        reason = self.kind.lacks.get(capability)
        if reason is not None:
            pytest.skip(f"{self.kind.name} lacks {capability}: {reason}")


@dataclass(frozen=True)
class StoreKind:
    name: str
    open: Callable[[], contextlib.AbstractContextManager[Opened]]
    lacks: dict[str, str] = field(default_factory=dict)


def connect(spec: dict[str, Any]) -> dist.Store:
    """A client of the store described by ``spec`` (used in other processes)."""
    timeout = timedelta(seconds=spec["timeout"])
    kind = spec["kind"]
    if kind == "tcpstore":
        return dist.TCPStore(spec["host"], spec["port"], is_master=False, timeout=timeout)
    if kind == "prefix-tcpstore":
        tcp = dist.TCPStore(spec["host"], spec["port"], is_master=False, timeout=timeout)
        return dist.PrefixStore(spec["prefix"], tcp)
    import elasticstore

    if kind in ("etcd", "prefix-etcd"):
        etcd = elasticstore.EtcdStore(spec["endpoints"], prefix=spec["prefix"], timeout=timeout,
                                      lease_ttl=spec.get("lease_ttl", 5.0))
        return etcd if kind == "etcd" else dist.PrefixStore(spec["torch_prefix"], etcd)
    store = elasticstore.Store(spec["host"], spec["port"], timeout=timeout)
    if kind == "elasticstore":
        return store
    if kind == "prefix-elasticstore":
        return dist.PrefixStore(spec["prefix"], store)
    if kind == "es-prefix-elasticstore":
        return elasticstore.PrefixStore(spec["prefix"], store)
    raise ValueError(f"unknown store kind {kind!r}")


@contextlib.contextmanager
def _open_elasticstore(prefix: str | None = None, ours: bool = False) -> Iterator[Opened]:
    """Our Store, alone or under a prefix: torch's PrefixStore (the trampoline path) or, with
    ``ours``, elasticstore.PrefixStore."""
    import elasticstore

    with elasticstore.StoreServer() as server:
        host, port = server.host, server.port

        def client() -> dist.Store:
            store = elasticstore.Store(host, port, timeout=DEFAULT_TIMEOUT)
            if prefix is None:
                return store
            return elasticstore.PrefixStore(prefix, store) if ours else dist.PrefixStore(prefix, store)

        kind, name = ("elasticstore", "elasticstore") if prefix is None else (
            ("es-prefix-elasticstore", "es-prefix") if ours else ("prefix-elasticstore", "prefix"))
        spec: dict[str, Any] = {
            "kind": kind,
            "host": host,
            "port": port,
            "prefix": prefix,
            "timeout": DEFAULT_TIMEOUT.total_seconds(),
        }
        yield Opened(KINDS_BY_NAME[name], client(), client, spec, server)


@contextlib.contextmanager
def _open_tcpstore() -> Iterator[Opened]:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=DEFAULT_TIMEOUT)
    host, port = "127.0.0.1", master.port

    def client() -> dist.Store:
        return dist.TCPStore(host, port, is_master=False, timeout=DEFAULT_TIMEOUT)

    spec = {"kind": "tcpstore", "host": host, "port": port,
            "timeout": DEFAULT_TIMEOUT.total_seconds()}
    yield Opened(KINDS_BY_NAME["tcpstore"], master, client, spec)


@contextlib.contextmanager
def _open_hashstore() -> Iterator[Opened]:
    store = dist.HashStore()
    store.set_timeout(DEFAULT_TIMEOUT)
    # A HashStore is one in-process map: "another client" is the same (thread-safe) object.
    yield Opened(KINDS_BY_NAME["hashstore"], store, lambda: store, None)


@contextlib.contextmanager
def _open_tcpstore_client_on_elasticstore(prefix: str | None = None) -> Iterator[Opened]:
    """torch's own TCPStore client speaking its protocol to our server (the second codec),
    optionally under torch's C++ PrefixStore."""
    import elasticstore

    with elasticstore.StoreServer() as server:
        host, port = server.host, server.port

        def client() -> dist.Store:
            tcp = dist.TCPStore(host, port, is_master=False, timeout=DEFAULT_TIMEOUT)
            return tcp if prefix is None else dist.PrefixStore(prefix, tcp)

        spec = {"kind": "tcpstore" if prefix is None else "prefix-tcpstore", "host": host,
                "port": port, "prefix": prefix, "timeout": DEFAULT_TIMEOUT.total_seconds()}
        name = "tcpstore-client" if prefix is None else "prefix-tcpstore-client"
        yield Opened(KINDS_BY_NAME[name], client(), client, spec, server)


@contextlib.contextmanager
def _open_etcd(torch_prefix: str | None = None) -> Iterator[Opened]:
    """EtcdStore on one shared etcd member (started on first use, see ``etcd_cluster``); each
    test gets a prefix of its own, so tests never see each other's keys."""
    import uuid

    import elasticstore
    from etcd_cluster import shared

    endpoints = shared().endpoints
    prefix = f"/conformance/{uuid.uuid4().hex}"
    clients: list[Any] = []

    def client() -> dist.Store:
        store = elasticstore.EtcdStore(endpoints, prefix=prefix, timeout=DEFAULT_TIMEOUT)
        clients.append(store)
        return store if torch_prefix is None else dist.PrefixStore(torch_prefix, store)

    spec = {"kind": "etcd" if torch_prefix is None else "prefix-etcd", "endpoints": endpoints,
            "prefix": prefix, "torch_prefix": torch_prefix,
            "timeout": DEFAULT_TIMEOUT.total_seconds()}
    try:
        yield Opened(KINDS_BY_NAME["etcd" if torch_prefix is None else "prefix-etcd"], client(),
                     client, spec)
    finally:
        for store in clients:
            store.close()


# What a store reached through torch's C++ PrefixStore (the Python trampoline) cannot do.
TRAMPOLINE_LACKS = {
    QUEUES: "torch's PythonStore trampoline does not forward queue calls",
    LIST_KEYS: "torch's PythonStore trampoline does not forward listKeys",
    BARRIER_WITHDRAWS: "torch's PrefixStore does not forward barrier: " + TORCH_BARRIER,
}
TORCH_CLIENT_GET = (
    "torch's TCPStore client sends WAIT, which a non-empty queue satisfies, then GET, which "
    "the server answers with an empty value"
)
# What torch's TCPStore client cannot do on our server.
TCPSTORE_CLIENT_LACKS = {
    GET_WAITS_FOR_A_VALUE: TORCH_CLIENT_GET,
    ADD_WRONG_TYPE: "torch's TCPStore protocol has no error reply: the server closes "
    "the connection on a failed add, as torch's own server does",
    BARRIER_WITHDRAWS: TORCH_BARRIER,
}

KINDS: list[StoreKind] = [
    StoreKind("elasticstore", _open_elasticstore),
    StoreKind(
        "tcpstore",
        _open_tcpstore,
        lacks={
            ADD_WRONG_TYPE: "its libuv server drops the connection on a failed add",
            BARRIER_WITHDRAWS: TORCH_BARRIER,
            STRICT_ADD: TORCH_ADD,
            GET_WAITS_FOR_A_VALUE: TORCH_CLIENT_GET,
        },
    ),
    StoreKind(
        "hashstore",
        _open_hashstore,
        lacks={
            MULTIPROCESS: "a HashStore lives inside one process",
            WAKE_BY_ADD: "torch's HashStore::add does not notify waiting threads",
            BARRIER_WITHDRAWS: TORCH_BARRIER,
            STRICT_ADD: TORCH_ADD,
        },
    ),
    # torch's C++ PrefixStore calling back into elasticstore.Store (the Python trampoline path).
    StoreKind(
        "prefix",
        lambda: _open_elasticstore(prefix="conformance"),
        lacks=TRAMPOLINE_LACKS,
    ),
    # elasticstore.PrefixStore: the prefix applied in Python, so every call (queues included)
    # reaches elasticstore.Store.
    StoreKind("es-prefix", lambda: _open_elasticstore(prefix="conformance", ours=True)),
    # torch's own TCPStore client speaking its protocol to our server (the second codec).
    StoreKind(
        "tcpstore-client",
        _open_tcpstore_client_on_elasticstore,
        lacks=TCPSTORE_CLIENT_LACKS,
    ),
    StoreKind(
        "prefix-tcpstore-client",
        lambda: _open_tcpstore_client_on_elasticstore(prefix="conformance"),
        lacks=TCPSTORE_CLIENT_LACKS,
    ),
    # EtcdStore on a real etcd (the same API over etcd v3 transactions, watches and leases).
    StoreKind("etcd", _open_etcd),
    # torch's C++ PrefixStore calling back into EtcdStore (values cross the int64 cast there).
    StoreKind(
        "prefix-etcd",
        lambda: _open_etcd(torch_prefix="conformance"),
        lacks=TRAMPOLINE_LACKS,
    ),
]
KINDS_BY_NAME = {kind.name: kind for kind in KINDS}
