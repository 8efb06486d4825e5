"""The small interface the handler needs from a store: versioned reads, compare-and-set,
watch, session-bound (liveness) keys. :class:`StoreBackend` implements it over any store of
the store contract (:class:`~elasticstore.stores.api.KVStore`: ``Store``, ``EtcdStore``);
subclasses supply the current revision.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from ..errors import StoreTimeoutError
from ..stores.api import KVStore, WatchEvent

if TYPE_CHECKING:
    from ..stores.native.server import StoreServer

__all__ = ["KeepFresh", "StoreBackend"]


class KeepFresh(Protocol):
    """A key kept fresh by :meth:`StoreBackend.keep_fresh`."""

    def beat(self) -> None: ...

    def stop(self) -> None: ...


S = TypeVar("S", bound=KVStore)


class StoreBackend(ABC, Generic[S]):
    """One connection (one session) to the rendezvous store.

    ``name`` is the registered backend name; ``endpoint`` names the store in error messages.
    Ephemeral keys live as long as this backend's session (native) or lease (etcd).
    """

    name: str = ""
    # True when a silent session (no FIN: partition, power loss) is not ended by the store
    # itself: the handler then keeps its liveness key fresh and ring watchers time it out.
    needs_heartbeat: bool = False
    server: StoreServer | None = None  # the rendezvous server this backend's process hosts (native), if any

    def __init__(self, store: S, endpoint: str) -> None:
        self.store = store
        self.endpoint = endpoint

    @abstractmethod
    def revision(self) -> int:
        """The store's current revision: watching after it misses no later change."""

    @abstractmethod
    def clone(self) -> StoreBackend:
        """A backend on a new connection (for a thread that blocks in ``watch``)."""

    def get(self, key: str) -> bytes | None:
        value: bytes | None = self.store.try_get(key)
        return value

    def set(self, key: str, value: str | bytes, ephemeral: bool = False) -> None:
        self.store.set(key, value, ephemeral=ephemeral) if ephemeral else self.store.set(key, value)

    def create(self, key: str, value: str | bytes, ephemeral: bool = False) -> bool:
        """Creates ``key`` if it is missing; True when this call created it."""
        swapped, _ = self.store.compare_set_ex(key, b"", value, ephemeral=ephemeral)
        return bool(swapped)

    def cas(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        """Sets ``key`` to ``desired`` if it holds ``expected`` (None: if it is missing)."""
        swapped, _ = self.store.compare_set_ex(key, expected or b"", desired)
        return bool(swapped)

    def delete(self, key: str) -> None:
        self.store.delete_key(key)

    def list(self, prefix: str) -> list[str]:
        keys: list[str] = self.store.list_keys(prefix)
        return keys

    def watch(self, prefix: str, after: int, timeout: float) -> WatchEvent | None:
        """The first change under ``prefix`` after revision ``after``; None after ``timeout`` s."""
        try:
            event: WatchEvent = self.store.watch(
                prefix, after, timedelta(seconds=max(timeout, 0.001)), prefix=True
            )
            return event
        except StoreTimeoutError:
            return None

    def keep_fresh(self, key: str, value: str, period: float, presence: str) -> KeepFresh:
        """Sets ``key`` (bound to a session of its own) to ``value`` plus a count now and every
        ``period`` seconds after, until ``stop()``, and creates ``presence`` on that session
        when it is missing; for a backend with ``needs_heartbeat``."""
        raise NotImplementedError(f"{self.name}: its store ends silent sessions itself")

    def close(self) -> None:
        self.store.close()
