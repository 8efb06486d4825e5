"""The old path of :mod:`elasticstore.stores.native.server`."""

from .stores.native.server import (
    LOG_LEVELS, ServerConfig, ServerLimits, StoreServer, format_address, resolve_host,
)

__all__ = ["LOG_LEVELS", "ServerConfig", "ServerLimits", "StoreServer", "format_address",
           "resolve_host"]
