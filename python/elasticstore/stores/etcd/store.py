"""``elasticstore.EtcdStore``: the Store API over etcd v3 (install ``elasticstore[etcd]``).

Layout, all under ``prefix`` (prefixes of two jobs must not nest, one a path prefix of the other)::

    {prefix}/kv/{key}              user keys (num_keys and list_keys count only these)
    {prefix}/q/{key}\\0{uuid}        queue items, ordered by their etcd create revision
    {prefix}/sys/barrier/{key}     a barrier: "{generation} {arrived} {world_size}" (no lease)
    {prefix}/sys/op/{store id}     this store's operation marker (bound to its lease)

Semantics (the mechanics are in ``txn``):

- ``add``, ``append``, ``compare_set``, ``delete_key``, barrier arrivals and queue pops are
  read-modify-write transactions compared on ``mod_revision``, retried while the key changes
  (bounded by the timeout), and applied exactly once even when a reply is lost and the call is
  retried on another member: a call that returns applied once. When a reply was lost and the
  lease (which holds the marker) ended before the retry, the call raises
  ``AmbiguousOutcomeError`` (a ``DistStoreError``) instead of applying twice. One that raises
  ``StoreNetworkError`` after sending may have applied (a late commit racing the deadline).
- ``get``, ``wait``, ``multi_get``, ``barrier`` and a blocking ``queue_pop`` read (revision R)
  and watch the missing keys from R+1: no update between the read and the watch is missed.
- ``set(..., ephemeral=True)`` binds the key to one lease per store (TTL ``lease_ttl``, default
  5 s), refreshed every TTL/3 by a daemon thread and revoked on ``close``: the key vanishes at
  close, or within the TTL when the owner dies.
- ``barrier(key, n)``: reusable, generation counted, an arrival that timed out is withdrawn,
  as the native server's; ``queue_*``: an item key each (both in ``sync``).
"""

from __future__ import annotations

import operator
import re
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

from etcd3 import etcdrpc

from ... import _C
from ...errors import AmbiguousOutcomeError, StoreError, StoreTimeoutError, WatchCompactedError
from ..api import DEFAULT_TIMEOUT, Key, KVStore, Timeout, Value, WatchEvent
from ..call_stats import etcd_recorded
from ..keepalive import PARKED, park
from .base import DELETE, deadline as deadline_of, range_end, to_bytes
from .sync import EtcdSyncPart
from .watch import EtcdWatchPart

__all__ = ["AmbiguousOutcomeError", "EtcdStore"]


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_DECIMAL = re.compile(rb"-?[0-9]+")  # the native server's counters (std::from_chars)


def _counter(raw: bytes) -> int | None:
    """A stored counter, or None when it is not strict decimal int64."""
    if _DECIMAL.fullmatch(raw) is None:
        return None
    value = int(raw)
    return value if _INT64_MIN <= value <= _INT64_MAX else None


def _int64_amount(amount: int) -> int:
    amount = operator.index(amount)
    if not _INT64_MIN <= amount <= _INT64_MAX:
        raise TypeError(f"add(): amount {amount} is outside int64")
    return amount


class EtcdStore(EtcdWatchPart, EtcdSyncPart):
    """A ``torch.distributed.Store`` on etcd v3 with the method set of :class:`Store`: the store
    contract (:class:`~elasticstore.stores.api.KVStore`), plus :meth:`revision`, :meth:`discard`
    and :meth:`delete_prefixes`.

    ``endpoints``: ``"host:port"`` strings (or one comma-separated string); on a network error
    the store moves to the next one, bounded by the timeout. ``ca_cert`` (and ``cert``/``key``
    for client authentication) switch to TLS; ``user``/``password`` to etcd auth.
    """

    def __init__(
        self,
        endpoints: str | Iterable[str],
        *,
        prefix: str = "/elasticstore",
        timeout: timedelta = DEFAULT_TIMEOUT,
        lease_ttl: timedelta | float = timedelta(seconds=5),
        connect_timeout: timedelta | None = None,
        ca_cert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        super().__init__()
        self._closed = True  # until connected: a store that failed to connect is never parked
        if isinstance(endpoints, str):
            endpoints = endpoints.split(",")
        eps = [e.strip().split("://", 1)[-1].rstrip("/") for e in endpoints if e.strip()]
        if not eps:
            raise ValueError("EtcdStore needs at least one endpoint 'host:port'")
        self._endpoints = eps
        self._prefix = prefix.rstrip("/")
        base = self._prefix.encode()
        self._kv, self._q, self._sys = base + b"/kv/", base + b"/q/", base + b"/sys/"
        self._ttl = lease_ttl.total_seconds() if isinstance(lease_ttl, timedelta) else lease_ttl
        self._connect_timeout = connect_timeout
        self._tls = {"ca_cert": ca_cert, "cert": cert, "key": key}
        self._auth = {"user": user, "password": password}
        self._lock = threading.Lock()
        self._init_marker(self._sys + b"op/" + uuid.uuid4().hex.encode())
        self._init_cursors()  # watch streams kept open between calls (watch.py)
        self._session = None
        self.set_timeout(timeout)
        self._session = self._open()
        self._closed = False

    # -- connection, lease, keep-alive -----------------------------------------------------------

    def close(self) -> None:
        """Revokes the lease (ephemeral keys vanish now) and closes the channels. Idempotent."""
        with self._lock:
            self._closed = True
            session, self._session = self._session, None
        PARKED.discard(self)
        self._close_cursors(final=True)
        if session is not None:
            session[1].stop(wait=True)
            session[0].close()

    def __del__(self) -> None:
        try:
            if self._closed:
                return
            session, self._session = self._session, None
            self._close_cursors(final=False)
            if not park(self):  # parked only while torch's C++ side holds it (see keepalive.py)
                self._closed = True  # nothing else holds it: freed now
            if session is not None:
                session[1].stop(wait=False)  # its thread revokes the lease; channels close later
        except Exception:  # interpreter shutdown: module globals may be gone
            pass

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- the torch.distributed.Store API -------------------------------------------------------

    def set(self, key: Key, value: Value, ephemeral: bool = False) -> None:  # type: ignore[override]
        """Sets ``key``; ``ephemeral=True`` binds it to this store's lease: it is deleted at
        ``close`` or within the lease TTL after the owner died."""
        conn, keeper = self._s()
        deadline = self._op_deadline()
        while True:
            lease = keeper.lease_id(deadline) if ephemeral else 0
            request = etcdrpc.PutRequest(key=self._k(key), value=to_bytes(value), lease=lease)
            try:
                conn.kv("Put", request, deadline, "set")
                return
            except StoreError as exc:
                if not (ephemeral and "lease not found" in str(exc)):
                    raise
                keeper.lost(lease)

    def get(self, key: Key) -> bytes:  # type: ignore[override]
        """Blocks until ``key`` exists or the store's timeout passes."""
        k = self._k(key)
        return self._wait([k], lambda kvs: k in kvs, None, "get")[k].value

    def try_get(self, key: Key) -> bytes | None:
        """The value, or None when the key is missing. Never blocks."""
        k = self._k(key)
        kvs, _ = self._read([k], self._op_deadline(), "try_get")
        return kvs[k].value if k in kvs else None

    def add(self, key: Key, amount: int) -> int:  # type: ignore[override]
        """Adds ``amount`` to the decimal int64 counter ``key`` (a missing key counts as 0) and
        returns the new value. As the native server: the stored value must be strict decimal
        (an optional ``-`` and ASCII digits), and a sum outside int64 is refused; both raise
        :class:`StoreError` before anything is written."""
        delta = _int64_amount(amount)

        def decide(kv: Any) -> tuple[tuple[Any, ...], int]:
            current = _counter(kv.value) if kv is not None else 0
            now = None if current is None else current + delta
            if now is None or not _INT64_MIN <= now <= _INT64_MAX:
                raise StoreError(f'add "{self._name(self._k(key))}": ADD: the value is not a '
                                 f"decimal int64, or overflowed")  # the native server's words
            return ("put", str(now).encode()), now

        return self._rmw(self._k(key), decide, "add")[0]  # type: ignore[no-any-return]

    def compare_set_ex(self, key: Key, expected: Value, desired: Value, *,
                       ephemeral: bool = False) -> tuple[bool, bytes | None]:
        """``(swapped, value now stored or None when the key is missing)``. An empty
        ``expected`` matches a missing key (creates it)."""
        exp, want = to_bytes(expected), to_bytes(desired)

        def decide(kv: Any) -> tuple[tuple[Any, ...] | None, tuple[bool, bytes | None]]:
            if kv is None:
                return (("put", want), (True, want)) if exp == b"" else (None, (False, None))
            if kv.value == exp:
                return ("put", want), (True, want)
            return None, (False, kv.value)

        return self._rmw(self._k(key), decide, "compare_set", lease_key=ephemeral)[0]

    def compare_set(self, key: Key, expected: Value, desired: Value) -> bytes:  # type: ignore[override]
        """torch's contract: the value now stored (``desired`` when it swapped), or ``expected``
        when the key is missing and nothing was set. See :meth:`compare_set_ex`."""
        _, value = self.compare_set_ex(key, expected, desired)
        return value if value is not None else to_bytes(expected)

    def wait(self, keys: list[Key], timeout: Timeout = None) -> None:  # type: ignore[override]
        """Until every name is a key or a queue holding items (as in torch's stores)."""
        self._wait_present(list(keys), timeout, "wait")

    def check(self, keys: list[Key]) -> bool:  # type: ignore[override]
        """Whether every name is a key or a queue holding items (as in torch's stores)."""
        return all(self._presence(list(keys), self._op_deadline(), "check")[0])

    def num_keys(self) -> int:
        request = etcdrpc.RangeRequest(key=self._kv, range_end=range_end(self._kv),
                                       count_only=True)
        return int(self._c().kv("Range", request, self._op_deadline(), "num_keys").count)

    def getNumKeys(self) -> int:  # noqa: N802 (torch's C++ name)
        return self.num_keys()

    def delete_key(self, key: Key) -> bool:  # type: ignore[override]
        return self._rmw(self._k(key), lambda kv: (("delete",), True) if kv is not None
                         else (None, False), "delete_key")[0]

    def deleteKey(self, key: Key) -> bool:  # noqa: N802 (torch's C++ name)
        return self.delete_key(key)

    def clone(self) -> EtcdStore:
        """A new store (own channels and lease) with the same settings (for another thread)."""
        return EtcdStore(self._endpoints, prefix=self._prefix, timeout=self.timeout,
                         lease_ttl=self._ttl, connect_timeout=self._connect_timeout,
                         **self._tls, **self._auth)

    def append(self, key: Key, value: Value) -> None:  # type: ignore[override]
        tail = to_bytes(value)
        self._rmw(self._k(key), lambda kv: (
            ("put", (kv.value if kv is not None else b"") + tail), None), "append")

    def multi_get(self, keys: list[Key]) -> list[bytes]:  # type: ignore[override]
        """Blocks until every key exists or the store's timeout passes."""
        full = [self._k(k) for k in keys]
        if not full:
            return []
        kvs = self._wait(full, lambda kvs: all(k in kvs for k in full), None, "multi_get")
        return [kvs[k].value for k in full]

    def multi_set(self, keys: list[Key], values: list[Value]) -> None:  # type: ignore[override]
        """Sets every key in one transaction."""
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        puts = [etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=self._k(k),
                                                                 value=to_bytes(v)))
                for k, v in zip(keys, values)]
        self._txn(self._op_deadline(), "multi_set", success=puts)

    def has_extended_api(self) -> bool:
        return True

    def list_keys(self, prefix: Key = "") -> list[str]:  # type: ignore[override]
        """Keys starting with ``prefix``, sorted."""
        start = self._k(prefix)
        request = etcdrpc.RangeRequest(key=start, range_end=range_end(start), keys_only=True)
        reply = self._c().kv("Range", request, self._op_deadline(), "list_keys")
        return sorted(self._name(kv.key) for kv in reply.kvs)

    # -- watch -----------------------------------------------------------------------------------

    def watch(self, key: Key, after_version: int | None = None, timeout: Timeout = None,
              prefix: bool = False) -> WatchEvent:
        """The first change to ``key`` (or, with ``prefix``, any key starting with it) after
        ``after_version`` (an etcd revision; None: after now), waiting up to ``timeout``.
        ``version`` of the event is the etcd ``mod_revision``. Raises
        :class:`~elasticstore.WatchCompactedError` when etcd compacted those revisions."""
        full = self._k(key)
        timeout = self.timeout if timeout is None else timeout
        deadline, start = deadline_of(timeout), time.monotonic()
        if after_version is None:
            after_version = self._read([], deadline, "watch")[1]
        end = range_end(full) if prefix else b""
        try:  # the stream stays open for the next call on this key (watch.py)
            ev = self._watch_next(full, end, int(after_version), deadline)
            name, value, version = self._name(ev.kv.key), ev.kv.value, ev.kv.mod_revision
            if ev.type == DELETE:
                return WatchEvent("delete", name, value, version)
            return WatchEvent("set", name, value, version)
        except WatchCompactedError as exc:
            raise WatchCompactedError(
                f"EtcdStore.watch: revisions after {after_version} of {key!r} were compacted",
                exc.oldest_revision) from None
        except StoreTimeoutError:
            raise StoreTimeoutError(
                f"EtcdStore.watch: no change of {key!r} after version {after_version} in "
                f"{time.monotonic() - start:.3f}s (timeout {timeout})") from None

    def ping(self) -> None:
        self._read([], self._op_deadline(), "ping")

    # -- etcd's own operations -------------------------------------------------------------------

    def revision(self) -> int:
        """etcd's current revision (one read): a :meth:`watch` with ``after_version`` set to it
        misses no later change. Bounded by the store's timeout."""
        return self._read([], self._op_deadline(), "revision")[1]

    def discard(self, key: Key) -> None:
        """Deletes ``key`` if it exists, in one request and without a result: for idempotent
        deletes, where :meth:`delete_key`'s exactly-once read-modify-write (three requests on a
        new lease) is not needed. Bounded by the store's timeout."""
        request = etcdrpc.DeleteRangeRequest(key=self._k(key))
        self._c().kv("DeleteRange", request, self._op_deadline(), "delete_key")

    def delete_prefixes(self, prefixes: Sequence[Key],
                        unless_prefix: Key | None = None) -> int | None:
        """Deletes every key starting with one of ``prefixes`` in one transaction, and returns
        how many; when ``unless_prefix`` is given and a key starting with it exists, deletes
        nothing and returns None. Bounded by the store's timeout; a retry after a lost reply
        may return 0 for keys it deleted."""
        T = etcdrpc.Compare
        compare = []
        if unless_prefix is not None:
            guard = self._k(unless_prefix)
            compare.append(T(key=guard, range_end=range_end(guard), target=T.CREATE,
                             result=T.EQUAL, create_revision=0))
        deletes = [etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(
            key=self._k(p), range_end=range_end(self._k(p)))) for p in prefixes]
        reply = self._txn(self._op_deadline(), "delete_prefixes", compare, deletes)
        if not reply.succeeded:
            return None
        return sum(int(r.response_delete_range.deleted) for r in reply.responses)


# Each call is counted for elasticstore.client_call_stats() (backend "etcd"), under the native
# client's operation names (_C.OPS: connecting and every store operation); compare_set, getNumKeys
# and deleteKey go through a counted method.
_COUNTED_METHODS = {"connect": "_open", "compare_set": "compare_set_ex"}
for _op, _code, _kind in _C.OPS:
    if _kind in ("session", "store"):
        _method = _COUNTED_METHODS.get(_op, _op)
        setattr(EtcdStore, _method, etcd_recorded(_op)(getattr(EtcdStore, _method)))
del _op, _code, _kind, _method

if TYPE_CHECKING:  # EtcdStore implements the store contract
    _CONTRACT: type[KVStore] = EtcdStore
