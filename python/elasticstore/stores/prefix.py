"""``elasticstore.PrefixStore``: a key prefix over an elasticstore store, queues included.

torch's ``torch.distributed.PrefixStore`` reaches a store written in Python through torch's
``PythonStore`` trampoline, which forwards the classic calls (``set``, ``get``, ``add``, ``wait``,
...) but not ``queue_push``/``queue_pop``/``queue_len`` nor ``list_keys``: over
``elasticstore.Store`` those raise ``NotImplementedError`` there. This store prefixes keys in
Python and forwards every call, so they work; torch can use it wherever it takes a store
(``init_process_group(store=...)``). A key ``k`` is ``prefix/k``, as under torch's PrefixStore, so
both name the same keys.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .api import Key, Timeout, Value

__all__ = ["PrefixStore"]


class PrefixStore(dist.Store):
    """Every key of ``store`` (an ``elasticstore.Store``, ``EtcdStore``, or another of these)
    under ``prefix + "/"``."""

    def __init__(self, prefix: str, store: Any) -> None:
        super().__init__()
        self._prefix = prefix
        self._store = store
        super().set_timeout(store.timeout)

    def __repr__(self) -> str:
        return f"elasticstore.PrefixStore({self._prefix!r}, {self._store!r})"

    @property
    def underlying_store(self) -> Any:
        return self._store

    def _k(self, key: Key) -> Key:
        if isinstance(key, bytes):
            return self._prefix.encode() + b"/" + key
        return f"{self._prefix}/{key}"

    def _ks(self, keys: list[Key]) -> list[Key]:
        return [self._k(k) for k in keys]

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self._store.set_timeout(timeout)

    def set(self, key: Key, value: Value) -> None:  # type: ignore[override]
        self._store.set(self._k(key), value)

    def get(self, key: Key) -> bytes:  # type: ignore[override]
        return bytes(self._store.get(self._k(key)))

    def add(self, key: Key, amount: int) -> int:  # type: ignore[override]
        return int(self._store.add(self._k(key), amount))

    def compare_set(self, key: Key, expected: Value, desired: Value) -> bytes:  # type: ignore[override]
        return bytes(self._store.compare_set(self._k(key), expected, desired))

    def wait(self, keys: list[Key], timeout: Timeout = None) -> None:  # type: ignore[override]
        if timeout is None:
            self._store.wait(self._ks(keys))
        else:
            self._store.wait(self._ks(keys), timeout)

    def check(self, keys: list[Key]) -> bool:  # type: ignore[override]
        return bool(self._store.check(self._ks(keys)))

    def num_keys(self) -> int:
        """The underlying store's count, as torch's PrefixStore returns."""
        return int(self._store.num_keys())

    def delete_key(self, key: Key) -> bool:  # type: ignore[override]
        return bool(self._store.delete_key(self._k(key)))

    def clone(self) -> PrefixStore:
        return PrefixStore(self._prefix, self._store.clone())

    def append(self, key: Key, value: Value) -> None:  # type: ignore[override]
        self._store.append(self._k(key), value)

    def multi_get(self, keys: list[Key]) -> list[bytes]:  # type: ignore[override]
        return [bytes(v) for v in self._store.multi_get(self._ks(keys))]

    def multi_set(self, keys: list[Key], values: list[Value]) -> None:  # type: ignore[override]
        self._store.multi_set(self._ks(keys), values)

    def has_extended_api(self) -> bool:
        return True

    def list_keys(self, prefix: Key = "") -> list[str]:  # type: ignore[override]
        """This store's keys starting with ``prefix`` (without this store's prefix), sorted."""
        mine = self._prefix + "/"
        start = prefix.decode() if isinstance(prefix, bytes) else prefix
        return [k[len(mine):] for k in self._store.list_keys(mine + start)]

    def queue_push(self, key: Key, value: Value) -> None:  # type: ignore[override]
        self._store.queue_push(self._k(key), value)

    def queue_pop(self, key: Key, block: bool = True, timeout: Timeout = None) -> bytes:  # type: ignore[override]
        return bytes(self._store.queue_pop(self._k(key), block, timeout))

    def queue_len(self, key: Key) -> int:  # type: ignore[override]
        return int(self._store.queue_len(self._k(key)))

    def barrier(self, key: Key, world_size: int, timeout: Timeout = None) -> int:  # type: ignore[override]
        return int(self._store.barrier(self._k(key), world_size, timeout))

    def try_get(self, key: Key) -> bytes | None:
        found = self._store.try_get(self._k(key))
        return None if found is None else bytes(found)
