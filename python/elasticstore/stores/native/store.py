"""``elasticstore.Store``: a ``torch.distributed.Store`` over the native client."""

from __future__ import annotations

import math
import os
import threading
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING

import torch.distributed as dist

from ... import _C
from ...errors import QueueEmptyError, StoreError
from ..api import DEFAULT_TIMEOUT, Key, KVStore, Timeout, Value, WatchEvent
from ..keepalive import PARKED, park
from .token import resolve_token

if TYPE_CHECKING:
    from .server import StoreServer

__all__ = ["Store", "WatchEvent"]


def _seconds(timeout: timedelta | float) -> float:
    """Seconds for ``_C``. Like torch's ``kNoTimeout``, zero or less waits forever."""
    secs = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return secs if secs > 0 else _C.NO_TIMEOUT


def _env_timeout(text: str) -> timedelta:
    """``ELASTICSTORE_TIMEOUT``: a positive, finite number of seconds that a timedelta holds."""
    try:
        secs = float(text)
    except ValueError:
        raise ValueError(f"ELASTICSTORE_TIMEOUT={text!r} is not a number of seconds") from None
    if not math.isfinite(secs) or secs <= 0:
        raise ValueError(f"ELASTICSTORE_TIMEOUT={text!r} must be a positive, finite number of "
                         "seconds")
    try:
        return timedelta(seconds=secs)
    except OverflowError:
        raise ValueError(f"ELASTICSTORE_TIMEOUT={text!r} is more seconds than a timedelta "
                         f"holds ({timedelta.max.total_seconds():.0f})") from None


def _as_bytes(value: Value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


# Keep-alive (see ../keepalive.py): a store dropped by Python while torch's C++ side still holds
# it parks itself in ``PARKED`` (its connection closed; the next C++ call reconnects) and is
# released once C++ lets it go; a store nothing else holds is freed. ``EtcdStore`` does the same.
class Store(dist.Store):
    """A ``torch.distributed.Store`` backed by an elasticstore server.

    ``timeout`` bounds every call: the blocking ones (``get``, ``wait``, ``multi_get``, ...) wait
    that long server-side when not given a timeout, and the others (``set``, ``add``, ``check``,
    ...) raise :class:`~elasticstore.StoreNetworkError`, naming the operation and its keys, when
    the server does not answer within it (reconnecting included). ``connect_timeout`` (default:
    ``timeout``) bounds connecting, retried with backoff. ``host`` is a numeric address or a name
    (resolved forward, within the timeout). A store used after ``fork()`` makes its own connection
    in the child (the parent's is left untouched). Keys and values may be ``str`` or ``bytes``; values come back as ``bytes``. Timeouts
    raise :class:`~elasticstore.StoreTimeoutError` (a ``DistStoreError``) and leave the store
    usable; lost connections raise :class:`~elasticstore.StoreNetworkError`.

    ``token`` is the server's shared token (docs/authentication.md): ``None`` reads
    ``ELASTICSTORE_TOKEN_FILE``, else ``ELASTICSTORE_TOKEN``; ``""`` connects without one. A
    failed handshake raises :class:`~elasticstore.AuthenticationError` naming the cause.
    """

    if TYPE_CHECKING:
        # torch's C++ property (read per call, see set_timeout); torch's stub does not declare it.
        timeout: timedelta

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout: timedelta = DEFAULT_TIMEOUT,
        connect_timeout: timedelta | None = None,
        client_name: str = "",
        token: str | None = None,
    ) -> None:
        super().__init__()
        self._token = resolve_token(token)
        self._host = host
        self._port = int(port)
        self._connect_timeout = connect_timeout
        self._client_name = client_name
        self._lock = threading.Lock()
        self._closed = True  # until connected: a store that failed to connect is never parked
        self._server: StoreServer | None = None  # a server this store hosts (init_method)
        self._client: _C.Client | None = None
        self.set_timeout(timeout)
        self._client = self._connect()
        self._closed = False

    # -- connection ---------------------------------------------------------------------------

    def _connect(self) -> _C.Client:
        budget = self._connect_timeout if self._connect_timeout is not None else self.timeout
        return _C.Client(
            self._host,
            self._port,
            connect_timeout=budget.total_seconds(),
            timeout=_seconds(self.timeout),
            client_name=self._client_name,
            token=self._token,
        )

    @classmethod
    def from_env(cls, *, client_name: str = "") -> Store:
        """A store from the environment a launcher sets: ``ELASTICSTORE_HOST``,
        ``ELASTICSTORE_PORT``, optionally ``ELASTICSTORE_TIMEOUT`` (seconds) and the token
        (``ELASTICSTORE_TOKEN_FILE``, else ``ELASTICSTORE_TOKEN``). Raises ``ValueError`` naming
        a variable that is missing or malformed."""
        host = os.environ.get("ELASTICSTORE_HOST", "")
        port_text = os.environ.get("ELASTICSTORE_PORT", "")
        if not host or not port_text:
            raise ValueError("Store.from_env() needs ELASTICSTORE_HOST and ELASTICSTORE_PORT")
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(f"ELASTICSTORE_PORT={port_text!r} is not a port number") from None
        timeout_text = os.environ.get("ELASTICSTORE_TIMEOUT")
        timeout = _env_timeout(timeout_text) if timeout_text else DEFAULT_TIMEOUT
        return cls(host, port, timeout=timeout, client_name=client_name)

    def allow_peers(self, addrs: list[str]) -> None:
        """Lets these addresses or CIDRs use torch's unauthenticated TCPStore protocol on a
        server with a token (the job vouches for them, e.g. a round's members)."""
        self._conn().allow_peers(list(addrs))

    def _conn(self) -> _C.Client:
        client = self._client
        if client is not None:
            return client
        with self._lock:  # parked (see keepalive.PARKED): reconnect on the first call
            if self._closed:
                raise StoreError(f"{self!r} is closed")
            if self._client is None:
                self._client = self._connect()
            return self._client

    def host_server(self, server: StoreServer) -> None:
        """Ties ``server`` to this store: it serves as long as the store lives, closed with it."""
        self._server = server

    def close(self) -> None:
        """Closes the connection (and a server this store hosts). Idempotent."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
            server, self._server = self._server, None
        PARKED.discard(self)
        if client is not None:
            client.close()
        if server is not None:
            server.close()

    def __del__(self) -> None:
        try:
            if self._closed:
                return
            client, self._client = self._client, None
            if park(self):  # resurrects self: torch's C++ side may still call it
                if client is not None:
                    client.close()
                return
            self._closed = True  # nothing else holds it: freed now
            server, self._server = self._server, None
            if client is not None:
                client.close()
            if server is not None:
                server.close()
        except Exception:  # interpreter shutdown: module globals may be gone
            pass

    def _release_parked(self) -> None:
        """Called once torch's C++ side let a parked store go (``keepalive.sweep``): closes its
        connection and a server it hosts. No lock: it may run inside a garbage collection."""
        self._closed = True
        client, self._client = self._client, None
        server, self._server = self._server, None
        if client is not None:
            client.close()
        if server is not None:
            server.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"elasticstore.Store({self._host!r}, {self._port}, {state})"

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    # -- timeouts -------------------------------------------------------------------------------

    def set_timeout(self, timeout: timedelta) -> None:
        """Sets the default timeout of blocking calls (also seen by torch's C++ side)."""
        if not isinstance(timeout, timedelta):
            raise TypeError(f"timeout must be a timedelta, got {type(timeout).__name__}")
        super().set_timeout(timeout)
        client = self._client
        if client is not None:  # the bound of calls that do not block server-side
            client.timeout = _seconds(timeout)

    @property
    def connect_timeout(self) -> timedelta | None:
        """How long connecting again keeps retrying (None: ``timeout``)."""
        return self._connect_timeout

    def set_connect_timeout(self, timeout: timedelta) -> None:
        """Sets how long connecting again, after the connection broke, keeps retrying (also for
        clones made from now on)."""
        if not isinstance(timeout, timedelta):
            raise TypeError(f"timeout must be a timedelta, got {type(timeout).__name__}")
        self._connect_timeout = timeout
        client = self._client
        if client is not None:
            client.connect_timeout = timeout.total_seconds()

    # ``timeout`` (a property) is inherited: it reads the C++ Store's member, which torch's C++
    # side may also set (``PrefixStore::setTimeout`` sets the wrapped store's, bypassing Python).
    # So it is read per call, never cached here.

    def _wait_secs(self, timeout: Timeout) -> float:
        return _seconds(self.timeout if timeout is None else timeout)

    # -- the torch.distributed.Store API (torch's C++ side calls these by name) ----------------

    def set(self, key: Key, value: Value, ephemeral: bool = False) -> None:  # type: ignore[override]
        """Sets ``key``; ``ephemeral=True`` binds it to this connection: it is deleted when the
        connection closes (the process dies included)."""
        self._conn().set(key, value, ephemeral)

    def get(self, key: Key) -> bytes:  # type: ignore[override]
        """Blocks until ``key`` exists (one round trip) or the store's timeout passes."""
        return self._conn().get(key, _seconds(self.timeout))

    def add(self, key: Key, amount: int) -> int:  # type: ignore[override]
        return self._conn().add(key, int(amount))

    def compare_set(self, key: Key, expected: Value, desired: Value) -> bytes:  # type: ignore[override]
        """torch's contract: the value now stored (``desired`` when it swapped), or ``expected``
        when the key is missing and nothing was set. See :meth:`compare_set_ex`."""
        _, value = self._conn().compare_set(key, expected, desired)
        return value if value is not None else _as_bytes(expected)

    def compare_set_ex(
        self, key: Key, expected: Value, desired: Value, *, ephemeral: bool = False
    ) -> tuple[bool, bytes | None]:
        """``(swapped, value now stored or None when the key is missing)``. An empty
        ``expected`` matches a missing key (creates it)."""
        return self._conn().compare_set(key, expected, desired, ephemeral)

    def wait(self, keys: list[Key], timeout: Timeout = None) -> None:  # type: ignore[override]
        self._conn().wait(list(keys), self._wait_secs(timeout))

    def check(self, keys: list[Key]) -> bool:  # type: ignore[override]
        return self._conn().check(list(keys))

    def num_keys(self) -> int:
        return self._conn().num_keys()

    def getNumKeys(self) -> int:  # noqa: N802 (torch's C++ name)
        return self.num_keys()

    def delete_key(self, key: Key) -> bool:  # type: ignore[override]
        return self._conn().delete_key(key)

    def deleteKey(self, key: Key) -> bool:  # noqa: N802 (torch's C++ name)
        return self.delete_key(key)

    def clone(self) -> Store:
        """A new store on a new connection with the same settings (for another thread)."""
        return Store(
            self._host,
            self._port,
            timeout=self.timeout,
            connect_timeout=self._connect_timeout,
            client_name=self._client_name,
            token=self._token,
        )

    def append(self, key: Key, value: Value) -> None:  # type: ignore[override]
        self._conn().append(key, value)

    def multi_get(self, keys: list[Key]) -> list[bytes]:  # type: ignore[override]
        """Blocks until every key exists or the store's timeout passes."""
        return self._conn().multi_get(list(keys), _seconds(self.timeout))

    def multi_set(self, keys: list[Key], values: list[Value]) -> None:  # type: ignore[override]
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        self._conn().multi_set(list(keys), list(values))

    def has_extended_api(self) -> bool:
        return True

    def list_keys(self, prefix: Key = "") -> list[str]:  # type: ignore[override]
        """Keys starting with ``prefix``, sorted."""
        return self._conn().list_keys(prefix)

    def queue_push(self, key: Key, value: Value) -> None:  # type: ignore[override]
        self._conn().queue_push(key, value)

    def queue_pop(self, key: Key, block: bool = True, timeout: Timeout = None) -> bytes:  # type: ignore[override]
        """Pops the oldest value. Blocking (the default), waits up to ``timeout`` (default: the
        store's) for a push; otherwise raises ``torch.distributed.QueueEmptyError`` at once when
        the queue is empty, as torch's stores do."""
        if not block:
            value = self._conn().queue_pop(key, 0.0)
            if value is None:
                raise QueueEmptyError(f"queue {key!r} is empty")
            return value
        value = self._conn().queue_pop(key, self._wait_secs(timeout))
        if value is None:  # only with a non-blocking pop; kept for safety
            raise QueueEmptyError(f"queue {key!r} is empty")
        return value

    def queue_len(self, key: Key) -> int:  # type: ignore[override]
        return self._conn().queue_len(key)

    def barrier(self, key: Key, world_size: int, timeout: Timeout = None) -> int:  # type: ignore[override]
        """Blocks until ``world_size`` participants reached barrier ``key``; returns the
        generation released (0, 1, 2, ...: the barrier is reusable). One round trip each."""
        return self._conn().barrier(key, int(world_size), self._wait_secs(timeout))

    # -- Python-level extras --------------------------------------------------------------------

    def try_get(self, key: Key) -> bytes | None:
        """The value, or None when the key is missing. Never blocks."""
        found = self._conn().try_get(key)
        return None if found is None else found[0]

    def watch(
        self,
        key: Key,
        after_version: int | None = None,
        timeout: Timeout = None,
        prefix: bool = False,
    ) -> WatchEvent:
        """The first change to ``key`` (or, with ``prefix``, to any key under it) after
        ``after_version`` (None: after now), waiting up to ``timeout`` for it. Loop with
        ``after_version=event.version`` to see every change in order. Raises
        :class:`~elasticstore.WatchCompactedError` when those changes left the history."""
        kind, name, value, version = self._conn().watch(
            key, after_version, self._wait_secs(timeout), prefix
        )
        return WatchEvent(kind, name, value, version)

    def keep_fresh(self, key: str, value: str, period: float, presence: str = "") -> _C.Heartbeat:
        """Binds ``key`` to a new connection of its own and sets it to ``f"{value} {n}"`` now
        (n = 1) and every ``period`` seconds after (n counting up), from a native thread that
        never takes the GIL; each beat also creates ``presence`` (when given, on the same
        session) with ``value`` if it is missing. ``stop()`` on the result ends the beats and
        the session, and so both keys."""
        return _C.Heartbeat(self._conn(), key, value, period, presence)

    def ping(self) -> None:
        self._conn().ping()

    def stats(self) -> dict[str, int]:
        """The server's counters (``revision``, ``keys``, ``connections``, ...)."""
        return dict(self._conn().stats())


if TYPE_CHECKING:  # Store implements the store contract
    _CONTRACT: type[KVStore] = Store
