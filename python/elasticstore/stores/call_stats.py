"""Counts and latencies of this process's store client calls, per operation.

:func:`client_call_stats` reports every call made so far by any :class:`~elasticstore.Store`
(the native client, ``backend="native"``, counted in C++ with relaxed atomic counters) or
:class:`~elasticstore.EtcdStore` (``backend="etcd"``, counted here) of this process: per
operation (``set``, ``get``, ``add``, ``compare_set``, ``wait``, ``multi_get``, ``watch``, ...,
and ``connect`` for connecting, reconnects included), the calls by outcome, their total time and
a latency histogram over the fixed bounds :data:`CLIENT_CALL_BUCKETS`. The counters only grow;
``elasticstore-run --metrics-port`` exports them (``elasticstore_store_client_*``).

Outcomes (:data:`CLIENT_CALL_OUTCOMES`): ``ok``: the call returned (a non-blocking
``queue_pop`` that found the queue empty included); ``timeout``: it raised
:class:`~elasticstore.StoreTimeoutError`; ``network``:
:class:`~elasticstore.StoreNetworkError` (no connection, a lost one, no reply in time, a closed
store); ``error``: any other error (an error reply, an interrupt, a compacted watch, ...). A
native call refused before it is sent (a key over the size limit, say) is not counted. A forked
child starts from its parent's counts.
"""

from __future__ import annotations

import os
import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from typing import TypeVar

from .. import _C
from ..errors import QueueEmptyError, StoreNetworkError, StoreTimeoutError

__all__ = ["CLIENT_CALL_BUCKETS", "CLIENT_CALL_OUTCOMES", "ClientCallStats", "client_call_stats"]

#: Upper bounds of the latency histogram in seconds (50 us to 60 s), shared with the C++ client.
CLIENT_CALL_BUCKETS: tuple[float, ...] = tuple(_C.CLIENT_CALL_BUCKETS)
#: How a call ended: ``("ok", "timeout", "network", "error")``.
CLIENT_CALL_OUTCOMES: tuple[str, ...] = tuple(_C.CLIENT_CALL_OUTCOMES)


@dataclass(frozen=True)
class ClientCallStats:
    """The calls of one operation of one backend since the process started."""

    backend: str  # "native" or "etcd"
    op: str  # "set", "get", "compare_set", ..., "connect"
    calls: dict[str, int]  # by outcome, every one of CLIENT_CALL_OUTCOMES present
    seconds: float  # total time of these calls
    # Calls per latency bucket (not cumulative): buckets[i] took at most CLIENT_CALL_BUCKETS[i]
    # (and more than the bound before); the last, one more than the bounds, took longer.
    buckets: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.calls.values())


class _Recorder:
    """The Python side's table, with the shape of the C++ one (etcd calls are milliseconds:
    one lock per call costs nothing there)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # op -> [calls by outcome (in CLIENT_CALL_OUTCOMES order)], seconds, [buckets]
        self._ops: dict[str, tuple[list[int], list[float], list[int]]] = {}

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at fork()

    def record(self, op: str, outcome: str, seconds: float) -> None:
        slot = CLIENT_CALL_OUTCOMES.index(outcome)
        bucket = bisect_left(CLIENT_CALL_BUCKETS, seconds)  # first bound >= seconds
        with self._lock:
            entry = self._ops.get(op)
            if entry is None:
                entry = self._ops[op] = ([0] * len(CLIENT_CALL_OUTCOMES), [0.0],
                                         [0] * (len(CLIENT_CALL_BUCKETS) + 1))
            entry[0][slot] += 1
            entry[1][0] += seconds
            entry[2][bucket] += 1

    def snapshot(self, backend: str) -> list[ClientCallStats]:
        with self._lock:
            return [ClientCallStats(backend, op, dict(zip(CLIENT_CALL_OUTCOMES, calls)),
                                    total[0], tuple(buckets))
                    for op, (calls, total, buckets) in sorted(self._ops.items())]


_ETCD = _Recorder()
os.register_at_fork(after_in_child=_ETCD.after_fork_in_child)

F = TypeVar("F", bound=Callable[..., object])


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, QueueEmptyError):  # a non-blocking pop: the native client's "ok" too
        return "ok"
    if isinstance(exc, StoreTimeoutError):
        return "timeout"
    if isinstance(exc, StoreNetworkError):
        return "network"
    return "error"


def etcd_recorded(op: str) -> Callable[[F], F]:
    """Wraps an ``EtcdStore`` method so that each call is counted as ``op``."""

    def wrap(fn: F) -> F:
        @wraps(fn)
        def call(*args: object, **kwargs: object) -> object:
            start = time.monotonic()
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                _ETCD.record(op, _outcome(exc), time.monotonic() - start)
                raise
            _ETCD.record(op, "ok", time.monotonic() - start)
            return result

        return call  # type: ignore[return-value]

    return wrap


def client_call_stats() -> list[ClientCallStats]:
    """The store client calls of this process so far: one entry per backend and operation
    called at least once (native first, by opcode; then etcd, by name). Cheap: reads counters."""
    native = [ClientCallStats("native", d["op"], dict(d["calls"]), d["seconds"],
                              tuple(d["buckets"]))
              for d in _C.client_call_stats()]
    return native + _ETCD.snapshot("etcd")
