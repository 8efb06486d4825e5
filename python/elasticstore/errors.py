"""Error classes of elasticstore.

They subclass what callers of a ``torch.distributed.Store`` already catch: store errors and
timeouts are ``torch.distributed.DistStoreError`` (itself a ``RuntimeError``), connection failures
are ``torch.distributed.DistNetworkError``. The native extension raises these classes directly
(``elasticstore`` registers them with ``_C._set_error_types`` at import).
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = [
    "AmbiguousOutcomeError",
    "AuthenticationError",
    "QueueEmptyError",
    "StoreError",
    "StoreNetworkError",
    "StoreTimeoutError",
    "WatchCompactedError",
]


class StoreError(dist.DistStoreError):
    """An error reply from the store (bad argument, wrong type, too large, protocol violation)."""


class StoreTimeoutError(StoreError):
    """A blocking call did not complete in time; the message names the keys and the time waited.

    The store stays usable after it.
    """


class AuthenticationError(StoreError):
    """The handshake could not authenticate: a wrong or missing token on either side, or a server
    that could not prove it holds the client's token. The message names the cause. The connection
    was closed before any key was touched; retrying does not help."""


class StoreNetworkError(dist.DistNetworkError):
    """The connection to the server could not be made or was lost."""


class WatchCompactedError(StoreError):
    """The changes after the requested revision were dropped from the server's watch history.

    ``oldest_revision`` is the oldest revision the server still holds: re-read the state and
    watch again after it.
    """

    def __init__(self, message: str, oldest_revision: int) -> None:
        super().__init__(message)
        self.oldest_revision = int(oldest_revision)

    def __reduce__(self) -> tuple[type[WatchCompactedError], tuple[str, int]]:
        return (type(self), (str(self), self.oldest_revision))


class AmbiguousOutcomeError(StoreError):
    """A mutation may or may not have applied: a request got no reply and the lease holding
    the operation marker (which would tell) ended before the retry. Read the key to find out;
    the store stays usable (a new lease is granted on the next call)."""


def _queue_empty_error() -> type[dist.DistStoreError]:
    """torch's ``QueueEmptyError`` (torch >= 2.8), or on older torch a ``StoreError`` of the
    same name, so that ``queue_pop(block=False)`` raises what callers of that torch catch."""
    found = getattr(dist, "QueueEmptyError", None)
    if isinstance(found, type) and issubclass(found, dist.DistStoreError):
        return found

    class QueueEmptyError(StoreError):
        """A non-blocking ``queue_pop`` found the queue empty (torch < 2.8 lacks its own)."""

    return QueueEmptyError


QueueEmptyError = _queue_empty_error()
