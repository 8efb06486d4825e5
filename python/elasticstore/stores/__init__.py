"""The stores: one contract (:mod:`.api`: :class:`KVStore`, :class:`WatchEvent`, the errors) and
its two implementations, :mod:`.native` (``Store`` on elasticstore's server, ``StoreServer``)
and :mod:`.etcd` (``EtcdStore``, the ``elasticstore[etcd]`` extra, imported on first use), with
what they share: the keep-alive of stores torch's C++ side still holds (:mod:`.keepalive`), the
client call statistics (:mod:`.call_stats`), and :class:`PrefixStore` over either.

Nothing here imports the layers above (rendezvous, agent, ops, train, the launcher).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .api import KVStore, WatchEvent
from .native import ServerConfig, ServerLimits, Store, StoreServer
from .prefix import PrefixStore

if TYPE_CHECKING:  # at run time EtcdStore is imported on first use
    from .etcd import EtcdStore

__all__ = ["KVStore", "PrefixStore", "ServerConfig", "ServerLimits", "Store", "StoreServer",
           "WatchEvent"]


def __getattr__(name: str) -> object:
    if name == "EtcdStore":
        from .etcd import EtcdStore

        return EtcdStore
    raise AttributeError(f"module 'elasticstore.stores' has no attribute {name!r}")
