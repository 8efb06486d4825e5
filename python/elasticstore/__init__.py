"""elasticstore: a native TCP key-value store for PyTorch distributed jobs.

``Store`` is a ``torch.distributed.Store``; ``StoreServer`` runs the native server in this
process; ``import elasticstore`` also registers the ``elasticstore://`` init_method scheme.
"""

from __future__ import annotations

from . import _C
from .errors import StoreError, StoreNetworkError, StoreTimeoutError, WatchCompactedError
from .init_method import register as _register_init_method
from .server import ServerConfig, StoreServer
from .store import Store, WatchEvent

__all__ = [
    "ServerConfig",
    "Store",
    "StoreError",
    "StoreNetworkError",
    "StoreServer",
    "StoreTimeoutError",
    "WatchCompactedError",
    "WatchEvent",
    "__version__",
]

__version__: str = _C.__version__

# The native side raises these classes directly (no per-call wrapping).
_C._set_error_types(
    store=StoreError,
    timeout=StoreTimeoutError,
    network=StoreNetworkError,
    compacted=WatchCompactedError,
)
_register_init_method()
