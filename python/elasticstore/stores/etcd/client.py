"""The etcd v3 plumbing under :class:`~elasticstore.EtcdStore`: gRPC channels to several
endpoints with failover, auth tokens, deadlines, watch streams, and a kept-alive lease.

Built on the generated stubs of ``etcd3.etcdrpc`` (PyPI ``python3-etcd3``), not on its client
class: each call here carries its own deadline, fails over to the next endpoint on a network
error, and re-authenticates when a member rejects a token (simple tokens are per member).
Imported only when an ``EtcdStore`` is made, so ``import elasticstore`` never needs grpc.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from etcd3 import etcdrpc

from ...errors import StoreError, StoreNetworkError

T = TypeVar("T")

# Seconds one unary attempt may take before the next endpoint is tried. A request forwarded by
# a follower whose leader died is never answered until etcd's own request timeout (> 5 s): this
# cap bounds that stall. A retried mutation is safe (exactly-once, see txn.py).
ATTEMPT_CAP = 1.0
_RETRY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
          grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED}
# Replies with code UNKNOWN that are a failover or a timeout: etcd's own errors, and a request
# whose deadline passed on the server first ("context deadline exceeded" with code UNKNOWN, not
# DEADLINE_EXCEEDED: seen from etcd 3.4 while its leader was lost; etcd-io/etcd#8809).
_RETRY_DETAILS = ("leader changed", "no leader", "request timed out", "too many requests",
                  "context deadline exceeded", "context canceled")
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


class _ChannelPool:
    """The process's gRPC channels, one per (endpoint, TLS files), shared by every
    :class:`Connection` to it and closed with the last one. A channel of its own per store
    would cost each store a polling thread and a completion queue in grpc (a rendezvous agent
    opens several stores; n agents in one process opened 2n threads of them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (pid, endpoint, TLS files) -> [channel, users]; the pid: a forked child never uses
        # its parent's channels (grpc's do not survive a fork), it makes its own.
        self._entries: dict[tuple[int, str, Any], list[Any]] = {}

    def acquire(self, target: str, tls: Any,
                creds: Any) -> tuple[grpc.Channel, tuple[int, str, Any]]:
        key = (os.getpid(), target, tls)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                if creds is not None:
                    channel = grpc.secure_channel(target, creds, _CHANNEL_OPTIONS)
                else:
                    channel = grpc.insecure_channel(target, _CHANNEL_OPTIONS)
                entry = self._entries[key] = [channel, 0]
            entry[1] += 1
            return entry[0], key

    def release(self, keys: list[tuple[int, str, Any]]) -> None:
        closing = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    continue
                entry[1] -= 1
                if entry[1] <= 0:
                    closing.append(self._entries.pop(key)[0])
        for channel in closing:
            channel.close()


_POOL = _ChannelPool()


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def retriable(exc: grpc.RpcError) -> bool:
    code = exc.code()
    if code in _RETRY:
        return True
    details = (exc.details() or "").lower()
    return code == grpc.StatusCode.UNKNOWN and any(d in details for d in _RETRY_DETAILS)


def _auth_expired(exc: grpc.RpcError) -> bool:
    details = (exc.details() or "").lower()
    return exc.code() == grpc.StatusCode.UNAUTHENTICATED or "invalid auth token" in details


class Connection:
    """Channels to ``endpoints`` ("host:port"), one in use at a time; :meth:`call` runs a gRPC
    call there and moves to the next endpoint on a network error until the deadline."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        ca_cert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        if (user is None) != (password is None):
            raise ValueError("EtcdStore: give both user and password, or neither")
        if (cert is None) != (key is None):
            raise ValueError("EtcdStore: give both cert and key, or neither")
        self.endpoints = list(endpoints)
        self._creds: Any = None
        if ca_cert is not None or cert is not None:
            def read(path: str | None) -> bytes | None:
                if path is None:
                    return None
                with open(path, "rb") as f:
                    return f.read()

            tls = (read(ca_cert), read(key), read(cert))
            self._tls: Any = tls
            self._creds = grpc.ssl_channel_credentials(*tls)
        else:
            self._tls = None
        self._user, self._password = user, password
        self._lock = threading.Lock()
        self._index = 0
        self._channels: dict[int, grpc.Channel] = {}  # from _POOL; released at close (or GC)
        self._pooled: list[tuple[int, str, Any]] = []
        self._release = weakref.finalize(self, _POOL.release, self._pooled)
        self._streams: set[Callable[[], None]] = set()  # cancels of the open watch streams
        self._tokens: dict[int, str] = {}
        self._closed = False
        # Requests sent without an answer (a network error or a lost reply): each may have been
        # applied unseen. The exactly-once transactions compare it before and after (etcd_txn).
        self.unanswered = 0

    def close(self) -> None:
        """Ends this connection's watch streams and releases its channels (shared: a unary
        call of another thread in flight ends within its attempt, ATTEMPT_CAP)."""
        with self._lock:
            self._closed = True
            self._channels = {}
            streams, self._streams = list(self._streams), set()
        for cancel in streams:
            cancel()
        self._release()

    def _channel(self, index: int) -> grpc.Channel:
        with self._lock:
            if self._closed:
                raise StoreError("EtcdStore is closed")
            channel = self._channels.get(index)
            if channel is None:
                target = self.endpoints[index]
                channel, pooled = _POOL.acquire(target, self._tls, self._creds)
                self._pooled.append(pooled)
                self._channels[index] = channel
            return channel

    def _metadata(self, index: int, deadline: float | None) -> list[tuple[str, str]]:
        if self._user is None:
            return []
        token = self._tokens.get(index)
        if token is None:
            stub = etcdrpc.AuthStub(self._channel(index))
            request = etcdrpc.AuthenticateRequest(name=self._user, password=self._password)
            token = stub.Authenticate(request, timeout=_attempt(deadline)).token
            self._tokens[index] = token
        return [("token", token)]

    def _fail_over(self, index: int) -> None:
        with self._lock:
            if self._index == index:
                self._index = (index + 1) % len(self.endpoints)

    def call(
        self,
        fn: Callable[[grpc.Channel, list[tuple[str, str]], float | None], T],
        deadline: float | None,
        what: str,
        network_deadline: float | None = None,
    ) -> T:
        """``fn(channel, metadata, attempt_timeout)`` on the endpoint in use; on a network error
        the next endpoint (after a short backoff once all were tried) until ``deadline``.

        Raises :class:`StoreNetworkError` when no endpoint answered in time, and
        :class:`StoreError` for an error reply.
        """
        tried = 0
        last: BaseException | None = None
        start = time.monotonic()
        while True:
            index = self._index
            try:
                return fn(self._channel(index), self._metadata(index, deadline), _attempt(deadline))
            except grpc.RpcError as exc:
                renew = self._user is not None and tried < 2 * len(self.endpoints)
                if renew and _auth_expired(exc):
                    self._tokens.pop(index, None)
                    tried += 1
                    continue
                if not retriable(exc):
                    raise StoreError(f"etcd {what}: {exc.code().name}: {exc.details()}") from None
                self.unanswered += 1
                last = exc
            self._tokens.pop(index, None)
            self._fail_over(index)
            tried += 1
            left = remaining(deadline)
            if left is not None and left <= 0:
                waited = time.monotonic() - start
                detail = last.details() if isinstance(last, grpc.RpcError) else last
                raise StoreNetworkError(
                    f"etcd {what}: no endpoint of {self.endpoints} answered within "
                    f"{waited:.1f}s (last error: {detail})"
                )
            if tried % len(self.endpoints) == 0:  # every endpoint failed once: back off
                time.sleep(min(0.05 * 2 ** min(tried // len(self.endpoints), 4),
                               max(0.0, left if left is not None else 1.0)))

    # -- unary helpers --------------------------------------------------------------------------

    def kv(self, method: str, request: Any, deadline: float | None, what: str) -> Any:
        def run(channel: grpc.Channel, md: list[tuple[str, str]], timeout: float | None) -> Any:
            return getattr(etcdrpc.KVStub(channel), method)(request, timeout=timeout, metadata=md)

        return self.call(run, deadline, what)

    def lease(self, method: str, request: Any, deadline: float | None, what: str) -> Any:
        def run(channel: grpc.Channel, md: list[tuple[str, str]], timeout: float | None) -> Any:
            stub = etcdrpc.LeaseStub(channel)
            if method == "LeaseKeepAlive":
                for reply in stub.LeaseKeepAlive(iter([request]), timeout=timeout, metadata=md):
                    return reply
                return None  # the stream closed without a reply: refreshed next period
            return getattr(stub, method)(request, timeout=timeout, metadata=md)

        return self.call(run, deadline, what)

    # -- watch streams --------------------------------------------------------------------------

    def watch_stream(
        self, creates: list[Any], deadline: float | None
    ) -> tuple[Iterator[Any], Callable[[], None], int]:
        """Opens a watch stream on the endpoint in use with ``creates`` (WatchCreateRequests).
        Returns (responses, cancel, endpoint index). Errors surface from the iterator as
        grpc.RpcError; the caller fails over with :meth:`stream_failed`."""
        index = self._index
        done = threading.Event()

        def requests() -> Iterator[Any]:
            for create in creates:
                yield etcdrpc.WatchRequest(create_request=create)
            done.wait()  # keep the stream open (no half-close) until the caller is finished

        md = self._metadata(index, deadline) + [("hasleader", "true")]
        timeout = remaining(deadline)
        call = etcdrpc.WatchStub(self._channel(index)).Watch(
            requests(), timeout=None if timeout is None else max(timeout, 0.001), metadata=md
        )

        def cancel() -> None:
            with self._lock:
                self._streams.discard(cancel)
            done.set()
            call.cancel()

        with self._lock:
            closed = self._closed
            if not closed:
                self._streams.add(cancel)
        if closed:
            cancel()
        return call, cancel, index

    def stream_failed(self, exc: grpc.RpcError | None, index: int | None = None) -> None:
        """A watch stream on endpoint ``index`` broke (or was cancelled for lack of a leader):
        the next endpoint (or, for an expired token, a new token)."""
        index = self._index if index is None else index
        if exc is not None and _auth_expired(exc):
            self._tokens.pop(index, None)
            return
        self._tokens.pop(index, None)
        self._fail_over(index)


def _attempt(deadline: float | None) -> float:
    left = remaining(deadline)
    return ATTEMPT_CAP if left is None else max(0.001, min(left, ATTEMPT_CAP))


class LeaseKeeper:
    """One lease per store, granted on first use, refreshed every ttl/3 by a daemon thread,
    revoked on :meth:`stop`. When it expired anyway (the store was cut off longer than the
    TTL), the next :meth:`lease_id` grants a new one; the keys bound to the old one are gone,
    as a native session's keys are when its connection drops."""

    def __init__(self, conn: Connection, ttl: float) -> None:
        self._conn = conn
        self.ttl = max(1, round(ttl))
        self._lock = threading.Lock()
        self._id = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.generation = 0  # bumped whenever a new lease replaces a lost one

    def lease_id(self, deadline: float | None) -> int:
        with self._lock:
            if self._stop.is_set():
                raise StoreError("EtcdStore is closed")
            if self._id == 0:
                reply = self._conn.lease(
                    "LeaseGrant", etcdrpc.LeaseGrantRequest(TTL=self.ttl), deadline, "lease grant"
                )
                self._id = reply.ID
                self.generation += 1
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="elasticstore-etcd-lease", daemon=True
                    )
                    self._thread.start()
            return self._id

    def lost(self, lease: int) -> None:
        with self._lock:
            if self._id == lease:
                self._id = 0

    def _run(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            lease = self._id
            if lease == 0:
                continue
            try:
                deadline = time.monotonic() + self.ttl / 3
                reply = self._conn.lease(
                    "LeaseKeepAlive", etcdrpc.LeaseKeepAliveRequest(ID=lease), deadline,
                    "lease keep-alive",
                )
                if reply is not None and reply.TTL <= 0:
                    self.lost(lease)
            except Exception:  # noqa: BLE001 (retried next period; the TTL is the bound)
                pass
        self._revoke()

    def _revoke(self) -> None:
        with self._lock:
            lease, self._id = self._id, 0
        if lease:
            try:
                self._conn.lease(
                    "LeaseRevoke", etcdrpc.LeaseRevokeRequest(ID=lease),
                    time.monotonic() + 2.0, "lease revoke",
                )
            except Exception:  # noqa: BLE001 (it expires within its TTL anyway)
                pass

    def stop(self, wait: bool = True) -> None:
        """Stops refreshing and revokes the lease (in the keeper thread; ``wait`` joins it)."""
        self._stop.set()
        thread = self._thread
        if thread is None:
            if wait:
                self._revoke()
            return
        if wait:
            thread.join(timeout=5.0)
