"""The old path of :mod:`elasticstore.stores.prefix`."""

from .stores.prefix import PrefixStore

__all__ = ["PrefixStore"]
