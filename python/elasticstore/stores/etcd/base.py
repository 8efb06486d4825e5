"""What every part of :class:`~elasticstore.EtcdStore` builds on: the key layout, the session
(a :class:`~.client.Connection` and its :class:`~.client.LeaseKeeper`, reopened after parking),
deadlines, and the helpers the parts share.

``EtcdStore`` is one class assembled from parts, each a module: this base, the exactly-once
transactions and waits (``txn``), barrier and queues (``sync``, over ``txn``), the kept-open
watch streams (``watch``) and the operations themselves (``store``).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from etcd3 import etcdrpc

from ...errors import StoreError
from ..api import Key, Timeout
from .client import Connection, LeaseKeeper

__all__ = ["DELETE", "PUT", "EtcdStoreBase", "Reread", "deadline", "range_end", "to_bytes"]

PUT, DELETE = 0, 1  # mvccpb.Event.EventType


def to_bytes(value: Key) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def range_end(prefix: bytes) -> bytes:
    """The etcd ``range_end`` that makes a range request cover every key starting with
    ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end[: len(end)])
        end.pop()
    return b"\x00"


def deadline(timeout: Timeout) -> float | None:
    """The monotonic deadline ``timeout`` from now; None (no deadline) for zero or less."""
    secs = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout or 0)
    return time.monotonic() + secs if secs > 0 else None


class Reread(Exception):
    """The watch cannot continue (stream broke, compaction, no leader): read again."""


class EtcdStoreBase(dist.Store):
    """The state that ``EtcdStore.__init__`` sets up and every part uses: the key layout under
    ``prefix`` (``_kv``, ``_q``, ``_sys``), the endpoints and their TLS/auth settings, and the
    session, opened on first use after the store was parked."""

    if TYPE_CHECKING:
        # torch's C++ property (read per call); torch's stub does not declare it.
        timeout: timedelta

    _endpoints: list[str]
    _prefix: str
    _kv: bytes
    _q: bytes
    _sys: bytes
    _ttl: float
    _connect_timeout: timedelta | None
    _tls: dict[str, Any]
    _auth: dict[str, Any]
    _lock: threading.Lock
    _closed: bool
    _session: tuple[Connection, LeaseKeeper] | None

    # -- connection, lease, keep-alive -----------------------------------------------------------

    def _open(self) -> tuple[Connection, LeaseKeeper]:
        conn = Connection(self._endpoints, **self._tls, **self._auth)
        budget = self._connect_timeout if self._connect_timeout is not None else self.timeout
        try:
            conn.call(
                lambda ch, md, t: etcdrpc.MaintenanceStub(ch).Status(
                    etcdrpc.StatusRequest(), timeout=t, metadata=md
                ),
                deadline(budget), "connect",
            )
        except BaseException:
            conn.close()
            raise
        return conn, LeaseKeeper(conn, self._ttl)

    def _s(self) -> tuple[Connection, LeaseKeeper]:
        session = self._session
        if session is not None:
            return session
        with self._lock:  # parked (see keepalive.PARKED): reconnect on the first call
            if self._closed:
                raise StoreError(f"{self!r} is closed")
            if self._session is None:
                self._session = self._open()
            return self._session

    def _c(self) -> Connection:
        return self._s()[0]

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"elasticstore.EtcdStore({','.join(self._endpoints)!r}, {self._prefix!r}, {state})"

    @property
    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    @property
    def prefix(self) -> str:
        return self._prefix

    def set_timeout(self, timeout: timedelta) -> None:
        if not isinstance(timeout, timedelta):
            raise TypeError(f"timeout must be a timedelta, got {type(timeout).__name__}")
        super().set_timeout(timeout)

    def _op_deadline(self) -> float | None:
        return deadline(self.timeout)

    def _k(self, key: Key) -> bytes:
        return self._kv + to_bytes(key)

    def _name(self, full: bytes) -> str:
        for base in (self._kv, self._sys, self._q):
            if full.startswith(base):
                return full[len(base):].decode("utf-8", "replace")
        return full.decode("utf-8", "replace")
