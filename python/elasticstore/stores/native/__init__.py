"""The store contract (:mod:`elasticstore.stores.api`) on elasticstore's own server: the client
adapter :class:`Store` (a ``torch.distributed.Store`` over the native ``_C`` client), the
in-process :class:`StoreServer`, its :class:`ServerLimits`, and the shared token."""

from __future__ import annotations

from .server import ServerConfig, StoreServer
from .server_limits import ServerLimits
from .store import Store
from .token import read_token_file, resolve_token

__all__ = ["ServerConfig", "ServerLimits", "Store", "StoreServer", "read_token_file",
           "resolve_token"]
