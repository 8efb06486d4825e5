"""The old path of :mod:`elasticstore.stores.call_stats`."""

from .stores.call_stats import (
    CLIENT_CALL_BUCKETS, CLIENT_CALL_OUTCOMES, ClientCallStats, client_call_stats,
)

__all__ = ["CLIENT_CALL_BUCKETS", "CLIENT_CALL_OUTCOMES", "ClientCallStats", "client_call_stats"]
