"""Watch cursors under :meth:`EtcdStore.watch <elasticstore.EtcdStore.watch>`: the watch stream
of one call stays open for the next call on the same key (or prefix), so a caller that loops
``after_version = event.version`` reads one stream instead of opening one per event.

Why: etcd serves a watch whose start revision is already past (``start_revision <= current
revision``) from its "unsynced" group, which a loop on the server catches up every 100 ms. A
caller that opens a stream per event and falls behind the writers (a rendezvous decider reading
n join events while n agents write them) waits up to 100 ms per event: O(n) x 100 ms. A cursor
opens its stream once; later events reach it as they are written.

A cursor holds the stream, a reader thread and the events received but not yet handed out (at
most :data:`MAX_BUFFERED`, or one reply into an empty buffer; beyond that it stops and the next
call opens a new stream). A call
with ``after_version`` at or past the cursor's position (the last revision it handed out) uses
it, skipping buffered events at or before ``after_version``; a call further back (or on another
key) opens a new one. A store keeps at most :data:`MAX_CURSORS` (the least recently used is
closed), each used by one call at a time; ``close()`` of the store closes them.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import grpc
from etcd3 import etcdrpc

from ...errors import StoreError, StoreTimeoutError, WatchCompactedError
from .base import EtcdStoreBase, Reread
from .client import Connection, remaining, retriable

MAX_BUFFERED = 4096  # events one cursor holds for later calls before it gives up its stream
MAX_CURSORS = 4  # open cursors per store
_RETRY_PAUSE = 0.02  # seconds before reopening after a broken stream (as txn._stream)


class _Closed(Exception):
    """The cursor was closed (by its store) while a call waited on it."""


class WatchCursor:
    """One open watch stream on ``key`` .. ``end`` (``end`` empty: the key alone)."""

    def __init__(self, conn: Connection, key: bytes, end: bytes, start_revision: int) -> None:
        self.key, self.end = key, end
        self.position = start_revision - 1  # every change up to here was handed out or skipped
        self._handed = 0  # the revision of the last event handed out (0: none yet)
        self._conn = conn
        self._cond = threading.Condition()
        self._events: collections.deque[Any] = collections.deque()
        self._error: BaseException | None = None
        self._closed = False
        create = etcdrpc.WatchCreateRequest(key=key, range_end=end, start_revision=start_revision)
        try:
            responses, self._cancel, self._index = conn.watch_stream([create], None)
        except grpc.RpcError as exc:  # authenticating on that endpoint failed
            conn.stream_failed(exc)
            time.sleep(_RETRY_PAUSE)
            raise Reread() from None
        self._thread = threading.Thread(target=self._read, args=(responses,), daemon=True,
                                        name="elasticstore-etcd-watch")
        self._thread.start()

    @property
    def usable(self) -> bool:
        with self._cond:
            return not self._closed and (self._error is None or bool(self._events))

    def _read(self, responses: Any) -> None:
        error: BaseException
        try:
            for reply in responses:
                if reply.compact_revision:
                    error = WatchCompactedError("compacted", reply.compact_revision)
                    break
                if reply.canceled:  # e.g. "no leader" (hasleader): read again elsewhere
                    self._conn.stream_failed(None, self._index)
                    error = Reread()
                    break
                if reply.events:
                    with self._cond:
                        # Nobody reads: give up (the next call reopens). A reply into an
                        # empty buffer is always taken, so every reopened stream progresses.
                        if self._events and len(self._events) + len(reply.events) > MAX_BUFFERED:
                            error = Reread()
                            break
                        self._events.extend(reply.events)
                        self._cond.notify_all()
            else:
                if not self._closed:
                    self._conn.stream_failed(None, self._index)
                error = Reread()
        except grpc.RpcError as exc:
            if self._closed:
                error = _Closed()
            elif not retriable(exc) and exc.code() != grpc.StatusCode.UNAUTHENTICATED:
                error = StoreError(f"etcd watch: {exc.code().name}: {exc.details()}")
            else:
                self._conn.stream_failed(exc, self._index)
                error = Reread()
        except Exception as exc:  # noqa: BLE001 (handed to the caller)
            error = exc
        with self._cond:
            self._error = error
            self._cond.notify_all()
        if not isinstance(error, _Closed):
            self._cancel()

    def next(self, after: int, deadline: float | None) -> Any:
        """The first event after revision ``after`` (the caller's position, at or past this
        cursor's). Raises StoreTimeoutError at ``deadline``; Reread, WatchCompactedError or
        StoreError when the stream ended (after the events it delivered)."""
        with self._cond:
            while True:
                while self._events:
                    ev = self._events.popleft()
                    rev = ev.kv.mod_revision
                    # Another change of the transaction the caller's last event came from
                    # (same revision) is still due to it: a fresh stream would skip it.
                    if rev > after or rev == after == self._handed:
                        self.position = self._handed = rev
                        return ev
                self.position = max(self.position, after)
                if self._closed:
                    raise _Closed()
                if self._error is not None:
                    raise self._error
                left = remaining(deadline)
                if left is not None and left <= 0:
                    raise StoreTimeoutError("deadline")
                self._cond.wait(left)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._cancel()


class EtcdWatchPart(EtcdStoreBase):
    """``_watch_next`` of :class:`~elasticstore.EtcdStore`, over a few :class:`WatchCursor`."""

    def _init_cursors(self) -> None:
        self._cursor_lock = threading.Lock()
        self._cursors: collections.OrderedDict[int, WatchCursor] = collections.OrderedDict()
        self._cursors_final = False

    def _take_cursor(self, key: bytes, end: bytes, after: int) -> WatchCursor | None:
        with self._cursor_lock:
            for ident, cursor in self._cursors.items():
                if cursor.key == key and cursor.end == end and cursor.position <= after:
                    del self._cursors[ident]
                    return cursor
        return None

    def _keep_cursor(self, cursor: WatchCursor) -> None:
        evicted: list[WatchCursor] = []
        with self._cursor_lock:
            if cursor.usable and not self._cursors_final:
                self._cursors[id(cursor)] = cursor
                while len(self._cursors) > MAX_CURSORS:
                    evicted.append(self._cursors.popitem(last=False)[1])
            else:
                evicted.append(cursor)
        for old in evicted:
            old.close()

    def _close_cursors(self, final: bool) -> None:
        """Closes every cursor (their streams end); later calls open new ones unless
        ``final`` (the store is closed)."""
        with self._cursor_lock:
            self._cursors_final = final or self._cursors_final
            cursors = list(self._cursors.values())
            self._cursors.clear()
        for cursor in cursors:
            cursor.close()

    def _watch_next(self, key: bytes, end: bytes, after: int, deadline: float | None) -> Any:
        """The first event on ``key`` .. ``end`` after revision ``after`` (a cursor's, or a new
        stream's that the next call may continue). Raises StoreTimeoutError at ``deadline``,
        WatchCompactedError, StoreError; a broken stream is reopened from ``after``."""
        while True:
            cursor = self._take_cursor(key, end, after)
            if cursor is None:
                left = remaining(deadline)
                if left is not None and left <= 0:
                    raise StoreTimeoutError("deadline")
                try:
                    cursor = WatchCursor(self._c(), key, end, after + 1)
                except Reread:
                    continue
            try:
                return cursor.next(after, deadline)
            except Reread:
                time.sleep(_RETRY_PAUSE)  # a new stream from ``after`` (the deadline first)
            except _Closed:
                pass  # the store was closed: opening a new stream raises that
            finally:
                self._keep_cursor(cursor)
