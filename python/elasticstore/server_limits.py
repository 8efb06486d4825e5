"""The old path of :mod:`elasticstore.stores.native.server_limits`."""

from .stores.native.server_limits import (
    KEEPALIVE_MAX_COUNT, KEEPALIVE_MAX_MS, ServerLimits, add_limit_flags, limits_from_args,
)

__all__ = ["KEEPALIVE_MAX_COUNT", "KEEPALIVE_MAX_MS", "ServerLimits", "add_limit_flags",
           "limits_from_args"]
