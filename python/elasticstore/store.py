"""The old path of :mod:`elasticstore.stores.native.store`."""

from .stores.native.store import Store, WatchEvent

__all__ = ["Store", "WatchEvent"]
