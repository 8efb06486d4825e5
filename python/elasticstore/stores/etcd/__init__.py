"""The store contract (:mod:`elasticstore.stores.api`) on etcd v3: :class:`EtcdStore`.

Needs the ``elasticstore[etcd]`` extra (``etcd3`` and ``grpcio``); importing this package
without it raises ``ImportError`` naming the extra.
"""

from __future__ import annotations

try:
    import grpc  # noqa: F401 (the extra's other half)
    from etcd3 import etcdrpc  # noqa: F401
except ImportError as exc:  # pragma: no cover (exercised without the extra)
    raise ImportError(
        f"EtcdStore needs the etcd client ({exc}): pip install elasticstore[etcd]"
    ) from exc

from ...errors import AmbiguousOutcomeError
from .store import EtcdStore

__all__ = ["AmbiguousOutcomeError", "EtcdStore"]
