"""The old path of :mod:`elasticstore.stores.etcd` (needs the ``elasticstore[etcd]`` extra)."""

from .stores.etcd import AmbiguousOutcomeError, EtcdStore

__all__ = ["AmbiguousOutcomeError", "EtcdStore"]
