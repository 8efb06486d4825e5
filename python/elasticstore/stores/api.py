"""The store contract: the operations that :class:`~elasticstore.Store` (the native server) and
:class:`~elasticstore.EtcdStore` (etcd v3) both implement, with the same guarantees.

Code that works with either store (the rendezvous, the ops commands, :class:`PrefixStore`) types
it as :class:`KVStore`. Keys and values are ``str`` or ``bytes`` (a ``str`` is sent as UTF-8);
values come back as ``bytes``.

Time bounds: every operation is bounded by the store's ``timeout`` (a ``timedelta``; set at
construction or by :meth:`KVStore.set_timeout`). An operation that blocks until something
exists or happens (``get``, ``wait``, ``multi_get``, a blocking ``queue_pop``, ``barrier``,
``watch``) waits up to its ``timeout`` argument when it has one, else the store's, and then
raises :class:`StoreTimeoutError`; the store stays usable. Any other operation raises
:class:`StoreNetworkError` when the server does not answer within the store's timeout
(reconnecting or failing over to another member included).

Errors (``torch.distributed.DistStoreError`` subclasses, but for :class:`StoreNetworkError`, a
``DistNetworkError``; a store raises no others, apart from ``ValueError``/``TypeError`` for
malformed arguments):

- :class:`StoreTimeoutError`: a blocking wait ran out.
- :class:`StoreNetworkError`: no answer in time, a lost connection. A mutation that raised it
  after being sent may have been applied.
- :class:`StoreError`: an error reply (a counter that is not decimal, a size limit, ...).
- :class:`AuthenticationError`: the server refused the credentials.
- :class:`WatchCompactedError`: the changes a ``watch`` asked for left the store's history.
- :class:`AmbiguousOutcomeError` (etcd only): a read-modify-write whose reply was lost and
  whose exactly-once record ended with the lease; read the key to learn whether it applied.
- :class:`QueueEmptyError`: a non-blocking ``queue_pop`` on an empty queue (torch's class).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Protocol, Union

from ..errors import (
    AmbiguousOutcomeError,
    AuthenticationError,
    QueueEmptyError,
    StoreError,
    StoreNetworkError,
    StoreTimeoutError,
    WatchCompactedError,
)

__all__ = [
    "AmbiguousOutcomeError",
    "AuthenticationError",
    "DEFAULT_TIMEOUT",
    "Key",
    "KVStore",
    "QueueEmptyError",
    "StoreError",
    "StoreNetworkError",
    "StoreTimeoutError",
    "Timeout",
    "Value",
    "WatchCompactedError",
    "WatchEvent",
]

Key = Union[str, bytes]
Value = Union[str, bytes]
#: A wait bound: a ``timedelta`` or seconds; ``None`` takes the store's ``timeout``.
Timeout = Union[timedelta, float, None]
#: A store's ``timeout`` unless given one.
DEFAULT_TIMEOUT = timedelta(seconds=300)


@dataclass(frozen=True)
class WatchEvent:
    """One change of a watched key: ``kind`` is ``"set"`` or ``"delete"``; ``version`` is the
    server revision of the change (pass it as ``after_version`` to get the next one)."""

    kind: Literal["set", "delete"]
    key: str
    value: bytes
    version: int


class KVStore(Protocol):
    """What every elasticstore store guarantees (besides ``torch.distributed.Store``'s API).

    Every operation is atomic and linearizable: once it returned, every later operation of any
    client sees its effect. Revisions (``WatchEvent.version``) grow with every change.
    """

    @property
    def timeout(self) -> timedelta:
        """The default bound of every operation (see the module doc)."""
        ...

    def set_timeout(self, timeout: timedelta) -> None:
        """Sets :attr:`timeout`. Raises ``TypeError`` for anything but a ``timedelta``."""

    # -- keys ------------------------------------------------------------------------------------

    def set(self, key: Key, value: Value, ephemeral: bool = False) -> None:
        """Sets ``key``. ``ephemeral=True`` binds it to this store's session (native: its
        connection; etcd: its lease): it is deleted at :meth:`close`, or once the owner died
        (native: the connection dropped; etcd: within the lease TTL)."""

    def get(self, key: Key) -> bytes:
        """The value of ``key``, waiting up to :attr:`timeout` for it to exist."""
        ...

    def try_get(self, key: Key) -> bytes | None:
        """The value, or ``None`` when ``key`` is missing. Never waits."""
        ...

    def add(self, key: Key, amount: int) -> int:
        """Adds ``amount`` to the decimal int64 counter ``key`` (missing: 0); returns the new
        value. A value that is not strict decimal, or a sum outside int64, raises
        :class:`StoreError` and writes nothing. Applied exactly once."""
        ...

    def compare_set(self, key: Key, expected: Value, desired: Value) -> bytes:
        """torch's contract: the value now stored (``desired`` when it swapped), or ``expected``
        when the key is missing and nothing was set."""
        ...

    def compare_set_ex(self, key: Key, expected: Value, desired: Value, *,
                       ephemeral: bool = False) -> tuple[bool, bytes | None]:
        """``(swapped, value now stored or None when the key is missing)``. An empty
        ``expected`` matches a missing key (creates it); ``ephemeral`` as in :meth:`set`."""
        ...

    def append(self, key: Key, value: Value) -> None:
        """Appends ``value`` to ``key`` (a missing key starts empty). Applied exactly once."""

    def delete_key(self, key: Key) -> bool:
        """Deletes ``key``; True when it existed."""
        ...

    def wait(self, keys: list[Key], timeout: Timeout = None) -> None:
        """Returns once every key exists; :class:`StoreTimeoutError` after ``timeout``. No change
        between checking and waiting is missed."""

    def check(self, keys: list[Key]) -> bool:
        """True when every key exists (a queue with items counts as a key). Never waits."""
        ...

    def multi_get(self, keys: list[Key]) -> list[bytes]:
        """The values of ``keys`` (one snapshot), waiting up to :attr:`timeout` for all."""
        ...

    def multi_set(self, keys: list[Key], values: list[Value]) -> None:
        """Sets every key at once. ``ValueError`` when the lengths differ."""

    def num_keys(self) -> int:
        """How many keys the store holds (queues and internal keys not counted on etcd)."""
        ...

    def list_keys(self, prefix: Key = "") -> list[str]:
        """The keys starting with ``prefix``, sorted."""
        ...

    # -- watch -----------------------------------------------------------------------------------

    def watch(self, key: Key, after_version: int | None = None, timeout: Timeout = None,
              prefix: bool = False) -> WatchEvent:
        """The first change of ``key`` (with ``prefix``: of any key starting with it) after
        revision ``after_version`` (``None``: after now), waiting up to ``timeout``. Looping
        with ``after_version=event.version`` sees every change in order. Raises
        :class:`WatchCompactedError` when those revisions left the history."""
        ...

    # -- queues and barriers ---------------------------------------------------------------------

    def queue_push(self, key: Key, value: Value) -> None:
        """Appends ``value`` to queue ``key`` (a retried push never duplicates it)."""

    def queue_pop(self, key: Key, block: bool = True, timeout: Timeout = None) -> bytes:
        """Pops the oldest value, each handed to one caller. Blocking waits up to ``timeout``;
        non-blocking raises :class:`QueueEmptyError` at once on an empty queue."""
        ...

    def queue_len(self, key: Key) -> int:
        """The number of values in queue ``key``."""
        ...

    def barrier(self, key: Key, world_size: int, timeout: Timeout = None) -> int:
        """Returns once ``world_size`` participants arrived at barrier ``key``: the generation
        released (0, 1, 2, ...; reusable). An arrival that timed out is withdrawn."""
        ...

    # -- the store itself ------------------------------------------------------------------------

    def ping(self) -> None:
        """One round trip to the server; :class:`StoreNetworkError` when it does not answer."""

    def clone(self) -> KVStore:
        """A new store with the same settings and a connection (session) of its own."""
        ...

    def close(self) -> None:
        """Ends the session (its ephemeral keys go) and the connection. Idempotent; later
        operations raise :class:`StoreError`."""
