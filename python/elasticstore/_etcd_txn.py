"""The etcd mechanics under :class:`~elasticstore.EtcdStore` (a mixin): exactly-once
read-modify-write transactions and waiting by a watch from the revision of a read.

Read-modify-write (``_rmw``): read the key (value, ``mod_revision``), compute, and commit only
if the key's ``mod_revision`` (``create_revision == 0`` for a missing key) is unchanged; else
retry with the current value that the failed transaction returned, bounded by the store's
timeout. The same transaction moves the store's operation marker (``{prefix}/sys/op/{id}``,
bound to its lease) from its previous value to ``"{seq}.{attempt}"`` and compares it, so at
most one attempt of an operation can commit. A reply lost on the wire is retried (on another
member): the retry fails the marker compare, and the marker says which attempt applied, with
which result. A call that returns therefore applied exactly once.

Waiting (``_wait``): read the keys in one snapshot (revision R in the reply header); if not
satisfied, watch them from R+1, so no change after the read is missed. A broken stream (member
down, no leader: streams carry ``hasleader``) or a compaction reads again, on the next member.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Union

import grpc
from etcd3 import etcdrpc

from ._etcd_client import Connection, LeaseKeeper, remaining, retriable
from .errors import StoreError, StoreTimeoutError, WatchCompactedError

Key = Union[str, bytes]
Value = Union[str, bytes]
Timeout = Union[timedelta, float, None]
_GONE = object()
_PUT, _DELETE = 0, 1  # mvccpb.Event.EventType


def _b(value: Key) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _range_end(prefix: bytes) -> bytes:
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end[: len(end)])
        end.pop()
    return b"\x00"


def _op_range(key: bytes, **kw: Any) -> Any:
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key, **kw))


def _deadline(timeout: Timeout) -> float | None:
    secs = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout or 0)
    return time.monotonic() + secs if secs > 0 else None


class _Reread(Exception):
    """The watch cannot continue (stream broke, compaction, no leader): read again."""


class EtcdTxnMixin:
    """Needs from the host: ``_s()`` (connection, lease keeper), ``_c()``, ``_name(key)``,
    ``timeout``, ``_op_deadline()``, and the marker state set up by :meth:`_init_marker`."""

    if TYPE_CHECKING:
        timeout: timedelta

        def _s(self) -> tuple[Connection, LeaseKeeper]: ...
        def _c(self) -> Connection: ...
        def _name(self, full: bytes) -> str: ...
        def _op_deadline(self) -> float | None: ...

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
        keeper = self._s()[1]
        deadline = self._op_deadline()
        with self._op_lock:
            self._seq += 1
            seq, results = self._seq, {}
            kvs, revision = self._read([key], deadline, what)
            current = kvs.get(key)
            attempt = 0
            while True:
                op, result = decide(current)
                if op is None:
                    return result, revision
                attempt += 1
                results[attempt] = result
                lease = keeper.lease_id(deadline)
                if keeper.generation != self._marker_gen:  # a new lease: the old marker is gone
                    self._marker_gen, self._marker = keeper.generation, None
                mark = f"{seq}.{attempt}".encode()
                T = etcdrpc.Compare
                compare = [
                    T(key=key, result=T.EQUAL, target=T.MOD, mod_revision=current.mod_revision)
                    if current is not None else
                    T(key=key, result=T.EQUAL, target=T.CREATE, create_revision=0),
                    T(key=self._marker_key, result=T.EQUAL, target=T.VALUE, value=self._marker)
                    if self._marker is not None else
                    T(key=self._marker_key, result=T.EQUAL, target=T.VERSION, version=0),
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
                    keeper.lost(lease)
                    continue
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
                self._marker = marker
                current = got_key[0] if got_key else None
                left = remaining(deadline)
                if left is not None and left <= 0:
                    raise StoreTimeoutError(f"EtcdStore.{what}: key {self._name(key)!r} kept "
                                            f"changing; gave up after {self.timeout}")

    # -- waiting on a watch from the read revision ---------------------------------------------

    def _wait(self, keys: list[bytes], ready: Callable[[dict[bytes, Any]], bool],
              timeout: Timeout, what: str) -> dict[bytes, Any]:
        """Reads ``keys``; until ``ready(kvs)``, watches them from the read revision + 1."""
        timeout = self.timeout if timeout is None else timeout
        deadline, start = _deadline(timeout), time.monotonic()
        while True:
            kvs, revision = self._read(keys, deadline, what)
            if ready(kvs):
                return kvs
            creates = [etcdrpc.WatchCreateRequest(key=k, start_revision=revision + 1)
                       for k in dict.fromkeys(keys)]
            try:
                for events in self._stream(creates, deadline):
                    for ev in events:
                        if ev.type == _DELETE:
                            kvs.pop(ev.kv.key, None)
                        else:
                            kvs[ev.kv.key] = ev.kv
                    if ready(kvs):
                        return kvs
            except (_Reread, WatchCompactedError):
                continue
            except StoreTimeoutError:
                secs = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
                missing = [self._name(k) for k in keys if k not in kvs] or \
                    [self._name(k) for k in keys]
                raise StoreTimeoutError(
                    f"EtcdStore.{what}: keys {missing} not ready after "
                    f"{time.monotonic() - start:.3f}s (timeout {secs}s)") from None

    def _stream(self, creates: list[Any], deadline: float | None) -> Iterable[list[Any]]:
        """Event batches of one watch stream; raises _Reread or StoreTimeoutError (deadline)."""
        conn = self._c()
        left = remaining(deadline)
        if left is not None and left <= 0:
            raise StoreTimeoutError("deadline")
        try:
            responses, cancel, index = conn.watch_stream(creates, deadline)
        except grpc.RpcError as exc:  # authenticating on that endpoint failed
            conn.stream_failed(exc)
            time.sleep(0.02)
            raise _Reread() from None
        try:
            for reply in responses:
                if reply.compact_revision:
                    raise WatchCompactedError("compacted", reply.compact_revision)
                if reply.canceled:  # e.g. "no leader" (hasleader): read again elsewhere
                    conn.stream_failed(None, index)
                    time.sleep(0.02)
                    raise _Reread()
                if reply.events:
                    yield list(reply.events)
            conn.stream_failed(None, index)
            raise _Reread()
        except grpc.RpcError as exc:
            left = remaining(deadline)
            if left is not None and left <= 0.01:
                raise StoreTimeoutError("deadline") from None
            if not retriable(exc) and exc.code() != grpc.StatusCode.UNAUTHENTICATED:
                raise StoreError(f"etcd watch: {exc.code().name}: {exc.details()}") from None
            conn.stream_failed(exc, index)
            time.sleep(0.02)
            raise _Reread() from None
        finally:
            cancel()

