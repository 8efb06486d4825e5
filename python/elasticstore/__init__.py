"""elasticstore: a native TCP key-value store for PyTorch distributed jobs.

``Store`` is a ``torch.distributed.Store``; ``EtcdStore`` the same API on etcd v3 (the
``elasticstore[etcd]`` extra, imported on first use); ``StoreServer`` runs the native server in this
process; ``import elasticstore`` also registers the ``elasticstore://`` init_method scheme.
``client_call_stats()`` reports this process's store client calls (counts, outcomes, latency).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _C
from .errors import (
    AmbiguousOutcomeError,
    AuthenticationError,
    QueueEmptyError,
    StoreError,
    StoreNetworkError,
    StoreTimeoutError,
    WatchCompactedError,
)
from .init_method import register as _register_init_method
from .stores.api import KVStore, WatchEvent
from .stores.call_stats import ClientCallStats, client_call_stats
from .stores.native import ServerConfig, ServerLimits, Store, StoreServer, read_token_file
from .stores.prefix import PrefixStore

if TYPE_CHECKING:  # for type checkers only: at run time EtcdStore is imported on first use
    from .stores.etcd import EtcdStore

__all__ = [  # EtcdStore is public too, but lazy: not here, so `import *` never needs etcd3
    "AmbiguousOutcomeError",
    "QueueEmptyError",
    "AuthenticationError",
    "KVStore",
    "PrefixStore",
    "ClientCallStats",
    "ServerConfig",
    "ServerLimits",
    "Store",
    "StoreError",
    "StoreNetworkError",
    "StoreServer",
    "StoreTimeoutError",
    "WatchCompactedError",
    "WatchEvent",
    "__version__",
    "client_call_stats",
    "read_token_file",
]

__version__: str = _C.__version__

# The native side raises these classes directly (no per-call wrapping).
_C._set_error_types(
    store=StoreError,
    timeout=StoreTimeoutError,
    network=StoreNetworkError,
    compacted=WatchCompactedError,
    authentication=AuthenticationError,
)
_register_init_method()


def __getattr__(name: str) -> object:
    # EtcdStore is imported on first use: ``import elasticstore`` never imports etcd3 or grpc;
    # without the extra, using it raises ImportError naming ``pip install elasticstore[etcd]``.
    if name == "EtcdStore":
        from .stores.etcd import EtcdStore

        return EtcdStore
    raise AttributeError(f"module 'elasticstore' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "EtcdStore"])
