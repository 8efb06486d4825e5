"""The liveness probe of the rendezvous store's host (native, agent-hosted, ``failover.py``).

A host whose process is gone is noticed at once (its connections are refused). A silent host
(SIGSTOPped, powered off, cut off) answers nothing, and a store call notices only when its reply
is overdue: ``store_timeout`` (60 s by default), which must stay long, since some calls wait
legitimately in the server (a blocking get, a long watch). The probe asks a call that never
waits (``stats``) every ``PROBE_PERIOD`` seconds on a connection of its own, and takes the host
for lost when no reply comes within ``silent_after(store_timeout)`` (``HOST_SILENT``, 10 s,
or ``store_timeout`` when smaller): a silent host is noticed within that bound whatever the other
calls wait for, and no legitimately slow call is cut.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

from ..errors import StoreError, StoreNetworkError
from ..stores.native.store import Store
from .failover import HostRecord, store_standing
from .state import Keys

__all__ = ["HOST_SILENT", "PROBE_PERIOD", "YIELD_PERIOD", "HostProbe", "NewerHostWatch", "silent_after"]

log = logging.getLogger(__name__)

HOST_SILENT = 10.0  # seconds without a reply to the probe after which the host is lost
PROBE_PERIOD = 1.0  # seconds between two probes
RECONNECT = timedelta(seconds=1)  # a host that refuses the reconnect is gone
YIELD_PERIOD = 2.0  # seconds between two looks of a host at the other endpoints' stores


def silent_after(store_timeout: float) -> float:
    """How long the probe waits for the host's reply."""
    return min(HOST_SILENT, store_timeout)


class HostProbe:
    """A thread that calls ``on_lost(error)`` once when the host at ``host:port`` stops
    answering (refused, reset or silent for ``silent``); ``stop()`` ends it at once."""

    def __init__(self, host: str, port: int, token: str | None, silent: float,
                 on_lost: Callable[[BaseException], None]) -> None:
        self._addr, self._silent, self._on_lost = (host, port), silent, on_lost
        self._token = token
        self._stop = threading.Event()
        self._store: Store | None = None
        self._thread = threading.Thread(target=self._run, name="rdzv-host-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        wait = timedelta(seconds=self._silent)
        try:
            self._store = store = Store(*self._addr, timeout=wait, connect_timeout=RECONNECT,
                                        token=self._token)
            if self._stop.is_set():
                store.close()
                return
            for _ in range(1 << 40):
                if self._stop.wait(PROBE_PERIOD):
                    return
                store.stats()
        except (StoreNetworkError, StoreError) as exc:
            if self._stop.is_set():
                return
            log.warning("the rendezvous store's host %s:%d did not answer the probe within "
                        "%gs: %s", *self._addr, self._silent, exc)
            error = StoreNetworkError(f"the store's host did not answer within {self._silent:g}s: {exc}")
            error.__cause__ = exc
            self._on_lost(error)
        except Exception as exc:  # never kills the process; a bug is logged
            if not self._stop.is_set():
                log.warning("the host probe failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        store = self._store
        if store is not None:
            try:
                store.close()
            except Exception:
                pass
        if threading.current_thread() is not self._thread:
            self._thread.join(2.0)


class NewerHostWatch:
    """On the node that hosts the store: every ``YIELD_PERIOD`` s, the stores served at the other
    endpoints; ``on_found(record)`` once when ``outranked(record, its round)`` says this node's
    store must give way (``failover.py``: a host cut off and back whose store the others left, a
    stale store that the others' newer rounds outrank, or a second host of one epoch). Calls at
    most one probe per endpoint per period."""

    def __init__(self, endpoints: list[tuple[str, int]], keys: Keys, token: str | None,
                 outranked: Callable[[HostRecord, int], bool],
                 on_found: Callable[[HostRecord], None]) -> None:
        self._endpoints, self._keys, self._token = endpoints, keys, token
        self._outranked, self._on_found = outranked, on_found
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rdzv-newer-host", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for _ in range(1 << 40):
                if self._stop.wait(YIELD_PERIOD):
                    return
                for host, port in self._endpoints:
                    found = store_standing(host, port, self._keys, self._token)
                    if found is not None and not self._stop.is_set() \
                            and self._outranked(found.record, found.round):
                        self._on_found(found.record)
                        return
        except Exception as exc:  # never kills the process; a bug is logged
            if not self._stop.is_set():
                log.warning("looking for a newer store host failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(2.0)
