"""The etcd mechanics under :class:`~elasticstore.EtcdStore` (a part of it): exactly-once
read-modify-write transactions and waiting by a watch from the revision of a read.

Read-modify-write (``_rmw``): read the key (value, ``mod_revision``), compute, and commit only
if the key's ``mod_revision`` (``create_revision == 0`` for a missing key) is unchanged; else
retry with the current value that the failed transaction returned, bounded by the store's
timeout. The same transaction moves the store's operation marker (``{prefix}/sys/op/{id}``,
bound to its lease) from its previous value to ``"{seq}.{attempt}"`` and compares it, so at
most one attempt of an operation can commit. A reply lost on the wire is retried (on another
member): the retry fails the marker compare, and the marker says which attempt applied, with
which result. A call that returns therefore applied exactly once.

The marker is written on a lease as soon as the lease is granted (before any attempt), so while
the lease lives the marker exists. When it is found missing in the middle of a call, the lease
ended (a partition longer than its TTL, or a revoke): if every request of the call was answered
(each attempt was refused), the call retries under a new lease; if one went unanswered, an
attempt may have applied and the only record of it is gone, so the call raises
:class:`AmbiguousOutcomeError` rather than apply it a second time. Markers are not moved off
the lease (which would make them survive): a marker outside a lease is never freed when its
store dies without ``close()``, one key per crashed process for good.

Waiting (``_wait``): read the keys in one snapshot (revision R in the reply header); if not
satisfied, watch them from R+1, so no change after the read is missed. A broken stream (member
down, no leader: streams carry ``hasleader``) or a compaction reads again, on the next member.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import grpc
from etcd3 import etcdrpc

from ...errors import AmbiguousOutcomeError, StoreError, StoreTimeoutError, WatchCompactedError
from ..api import Timeout
from .base import DELETE, EtcdStoreBase, Reread, deadline as deadline_of
from .client import LeaseKeeper, remaining, retriable

_GONE = object()


def _op_range(key: bytes, **kw: Any) -> Any:
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key, **kw))


_MARKER_START = b"0"  # a marker on a new lease (operations write "{seq}.{attempt}", seq >= 1)


class EtcdTxnPart(EtcdStoreBase):
    """The transactions and waits of :class:`~elasticstore.EtcdStore` (see the module doc), over
    the marker state set up by :meth:`_init_marker`."""

    def _init_marker(self, marker_key: bytes) -> None:
        import threading

        self._op_lock = threading.Lock()  # serializes this store's marked transactions
        self._marker_key = marker_key
        self._marker: bytes | None = None  # its value after our last op (None: missing)
        self._marker_gen = 0
        self._seq = 0
        self.recovered = 0  # operations whose lost reply was recovered from the marker

    # -- transactions ----------------------------------------------------------------------------

    def _txn(self, deadline: float | None, what: str, compare: list[Any] | None = None,
             success: list[Any] | None = None, failure: list[Any] | None = None) -> Any:
        request = etcdrpc.TxnRequest(compare=compare or [], success=success or [],
                                     failure=failure or [])
        return self._c().kv("Txn", request, deadline, what)

    def _read(
        self, keys: list[bytes], deadline: float | None, what: str
    ) -> tuple[dict[bytes, Any], int]:
        """The kvs of ``keys`` in one snapshot, and its revision."""
        reply = self._txn(deadline, what, success=[_op_range(k) for k in keys])
        kvs = {r.response_range.kvs[0].key: r.response_range.kvs[0]
               for r in reply.responses if r.response_range.kvs}
        return kvs, reply.header.revision

    def _rmw(self, key: bytes, decide: Callable[[Any], tuple[tuple[Any, ...] | None, Any]],
             what: str, lease_key: bool = False) -> tuple[Any, int]:
        """Read-modify-write of ``key``, applied exactly once (see the module doc).

        ``decide(kv or None)`` returns ``(op, result)``: op ``("put", value)``, ``("delete",)`` or
        None (nothing to write: return ``result`` now). Returns (result, revision)."""
        conn, keeper = self._s()
        deadline = self._op_deadline()
        with self._op_lock:
            self._seq += 1
            seq, results = self._seq, {}
            kvs, revision = self._read([key], deadline, what)
            current = kvs.get(key)
            attempt, lease = 0, 0
            unanswered = conn.unanswered
            while True:
                op, result = decide(current)
                if op is None:
                    return result, revision
                if lease == 0:
                    lease = self._marker_lease(keeper, deadline, what)
                attempt += 1
                results[attempt] = result
                mark = f"{seq}.{attempt}".encode()
                T = etcdrpc.Compare
                compare = [
                    T(key=key, result=T.EQUAL, target=T.MOD, mod_revision=current.mod_revision)
                    if current is not None else
                    T(key=key, result=T.EQUAL, target=T.CREATE, create_revision=0),
                    T(key=self._marker_key, result=T.EQUAL, target=T.VALUE, value=self._marker),
                ]
                if op[0] == "put":
                    write = etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(
                        key=key, value=op[1], lease=lease if lease_key else 0))
                else:
                    write = etcdrpc.RequestOp(
                        request_delete_range=etcdrpc.DeleteRangeRequest(key=key))
                success = [write, etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(
                    key=self._marker_key, value=mark, lease=lease))]
                try:
                    reply = self._txn(deadline, what, compare, success,
                                      [_op_range(key), _op_range(self._marker_key)])
                except StoreError as exc:
                    if "lease not found" not in str(exc):
                        raise
                    lease = self._lease_lost(keeper, lease, conn.unanswered != unanswered,
                                             what, key, attempt)
                    continue  # this attempt was refused: read the key again
                revision = reply.header.revision
                if reply.succeeded:
                    self._marker = mark
                    return result, revision
                got_key, got_mark = (r.response_range.kvs for r in reply.responses)
                marker = got_mark[0].value if got_mark else None
                if marker is not None and marker.startswith(f"{seq}.".encode()):
                    self._marker = marker  # an earlier attempt applied (its reply was lost)
                    self.recovered += 1
                    return results[int(marker.split(b".")[1])], revision
                current = got_key[0] if got_key else None
                if marker != self._marker:  # the marker went with the lease
                    lease = self._lease_lost(keeper, lease, conn.unanswered != unanswered,
                                             what, key, attempt)
                left = remaining(deadline)
                if left is not None and left <= 0:
                    raise StoreTimeoutError(f"EtcdStore.{what}: key {self._name(key)!r} kept "
                                            f"changing; reached its timeout after {self.timeout}")

    def _marker_lease(self, keeper: LeaseKeeper, deadline: float | None, what: str) -> int:
        """The lease for an operation's attempts, with this store's marker on it. The marker is
        written (``"0"``) as soon as a lease is new, before any attempt: while the lease lives
        the marker exists, so a marker found missing means the lease ended."""
        while True:
            lease = keeper.lease_id(deadline)
            if self._marker is not None and keeper.generation == self._marker_gen:
                return lease
            put = etcdrpc.PutRequest(key=self._marker_key, value=_MARKER_START, lease=lease)
            try:
                self._c().kv("Put", put, deadline, what)
            except StoreError as exc:
                if "lease not found" not in str(exc):
                    raise
                keeper.lost(lease)
                continue
            self._marker_gen, self._marker = keeper.generation, _MARKER_START
            return lease

    def _lease_lost(self, keeper: LeaseKeeper, lease: int, unseen: bool, what: str,
                    key: bytes, attempt: int) -> int:
        """The lease (and the marker on it) ended during an operation. When a request of the
        operation went unanswered, one of its attempts may have applied and the marker that
        would say so is gone: raise :class:`AmbiguousOutcomeError`. Otherwise every attempt was
        answered as not applied: retry under a new lease (returns 0: no lease yet)."""
        keeper.lost(lease)
        self._marker = None
        if unseen:
            raise AmbiguousOutcomeError(
                f"EtcdStore.{what} on key {self._name(key)!r}: outcome unknown: a request of "
                f"this call ({attempt} attempt(s)) got no reply, and the store's lease (with the "
                f"marker saying whether it applied) ended before the retry (a partition longer "
                f"than the lease TTL, {keeper.ttl}s, or a revoked lease); read the key to see "
                f"whether it applied")
        return 0

    # -- waiting on a watch from the read revision ---------------------------------------------

    def _wait(self, keys: list[bytes], ready: Callable[[dict[bytes, Any]], bool],
              timeout: Timeout, what: str) -> dict[bytes, Any]:
        """Reads ``keys``; until ``ready(kvs)``, watches them from the read revision + 1."""
        timeout = self.timeout if timeout is None else timeout
        deadline, start = deadline_of(timeout), time.monotonic()
        while True:
            kvs, revision = self._read(keys, deadline, what)
            if ready(kvs):
                return kvs
            creates = [etcdrpc.WatchCreateRequest(key=k, start_revision=revision + 1)
                       for k in dict.fromkeys(keys)]
            try:
                for events in self._stream(creates, deadline):
                    for ev in events:
                        if ev.type == DELETE:
                            kvs.pop(ev.kv.key, None)
                        else:
                            kvs[ev.kv.key] = ev.kv
                    if ready(kvs):
                        return kvs
            except (Reread, WatchCompactedError):
                continue
            except StoreTimeoutError:
                secs = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
                missing = [self._name(k) for k in keys if k not in kvs] or \
                    [self._name(k) for k in keys]
                raise StoreTimeoutError(
                    f"EtcdStore.{what}: keys {missing} not ready after "
                    f"{time.monotonic() - start:.3f}s (timeout {secs}s)") from None

    def _stream(self, creates: list[Any], deadline: float | None) -> Iterable[list[Any]]:
        """Event batches of one watch stream; raises Reread or StoreTimeoutError (deadline)."""
        conn = self._c()
        left = remaining(deadline)
        if left is not None and left <= 0:
            raise StoreTimeoutError("deadline")
        try:
            responses, cancel, index = conn.watch_stream(creates, deadline)
        except grpc.RpcError as exc:  # authenticating on that endpoint failed
            conn.stream_failed(exc)
            time.sleep(0.02)
            raise Reread() from None
        try:
            for reply in responses:
                if reply.compact_revision:
                    raise WatchCompactedError("compacted", reply.compact_revision)
                if reply.canceled:  # e.g. "no leader" (hasleader): read again elsewhere
                    conn.stream_failed(None, index)
                    time.sleep(0.02)
                    raise Reread()
                if reply.events:
                    yield list(reply.events)
            conn.stream_failed(None, index)
            raise Reread()
        except grpc.RpcError as exc:
            left = remaining(deadline)
            if left is not None and left <= 0.01:
                raise StoreTimeoutError("deadline") from None
            if not retriable(exc) and exc.code() != grpc.StatusCode.UNAUTHENTICATED:
                raise StoreError(f"etcd watch: {exc.code().name}: {exc.details()}") from None
            conn.stream_failed(exc, index)
            time.sleep(0.02)
            raise Reread() from None
        finally:
            cancel()

