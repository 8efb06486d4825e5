"""How a round and a run end, seen from one node: the watch on the round's restart record
(``RoundWatch``), the reason a run was closed (``closed_reason_of``, ``stop_reason_of``) and, for
the node that hosts the rendezvous server, serving until the other nodes left (``wait_alone``).

The closed record is ``{"reason": ...}`` (``elasticstore stop`` writes "stopped by operator"; an
agent whose workers all succeeded writes "finished", so the run id of a finished job is refused
until ``elasticstore forget``) or ``1`` (the restarts spent). ``elasticstore stop`` also ends the
current round with a restart record that carries the same reason under ``closed``: a node learns
that the run closed from the very event that wakes it, with no second read that could find the
store gone (its host may have left already).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from torch.distributed.elastic.rendezvous import RendezvousClosedError

from ..errors import StoreNetworkError, WatchCompactedError
from . import registry
from .backend import StoreBackend
from .records import parse_json

__all__ = ["FINISHED", "WAIT_SLICE", "EndedWatch", "RoundWatch", "closed_error", "closed_reason_of", "forget_hint", "parse_json",
           "stop_reason_of", "wait_alone"]

ETCD_PREFIX = "/elasticstore/rdzv"  # the default of rdzv-conf etcd_prefix and --etcd-prefix
WAIT_SLICE = 1.0  # seconds: the longest single watch while serving until the others left
WATCH_SLICE = 10.0  # seconds: the longest single watch of a round's end (RoundWatch)
FINISHED = "finished"  # the closing reason of a run whose workers succeeded


def closed_reason_of(data: bytes | None) -> str | None:
    """The reason in a closed record (None: no reason given, or not JSON)."""
    obj = parse_json(data)
    return str(obj["reason"]) if isinstance(obj, dict) and "reason" in obj else None


def stop_reason_of(data: bytes | None) -> str | None:
    """The closing reason a restart record carries (``elasticstore stop`` writes one)."""
    obj = parse_json(data)
    return str(obj["closed"]) if isinstance(obj, dict) and "closed" in obj else None


def closed_error(reason: str | None, backend: str, endpoint: str, run_id: str,
                 etcd_prefix: str = ETCD_PREFIX) -> RendezvousClosedError:
    """What a node joining a closed run raises: why it closed and how to reuse the run id."""
    why = (" (finished: a job with this run id already succeeded)" if reason == FINISHED
           else f" ({reason})" if reason else "")
    return RendezvousClosedError(f"rendezvous {run_id!r} is closed{why}; "
                                 + forget_hint(backend, endpoint, run_id, etcd_prefix))


def forget_hint(backend: str, endpoint: str, run_id: str, etcd_prefix: str = ETCD_PREFIX) -> str:
    """How to reuse a closed run id: the command that removes the run's keys."""
    etcd = ""
    row = registry.backend(backend)
    if row.store_kind == "etcd":
        etcd = f" --rdzv-backend {row.label}" + (
            f" --etcd-prefix {etcd_prefix}" if etcd_prefix != ETCD_PREFIX else "")
    return (f"to reuse the run id, remove its keys: elasticstore forget{etcd} --rdzv-endpoint "
            f"{endpoint} --rdzv-id {run_id}")


class RoundWatch:
    """Waits for a round's restart signal; ``close()`` from another thread ends ``wait`` at once.
    ``on_stop(reason)`` is told when the restart record says the run was closed."""

    def __init__(self, backend: StoreBackend, key: str,
                 on_stop: Callable[[str], None] | None = None,
                 on_lost: Callable[[BaseException], None] | None = None) -> None:
        self._b, self._key, self._on_stop = backend, key, on_stop
        self._on_lost = on_lost  # told of a lost store, which then ends the round (failover.py)
        self._closed = False
        self._ended = False  # end(): the store's host was found lost elsewhere (the host probe)
        self._watching = threading.Event()  # a wait is reading the store (end's grace)
        self._returned = threading.Event()
        self.slice = WATCH_SLICE  # seconds of one watch: no reply within slice + store_timeout is a loss

    def end(self, grace: float = 0.0) -> None:
        """The round is over (its store's host is lost, as another thread found): ``wait``
        returns True at once, now or when next called. With ``grace``, a ``wait`` in progress
        in another thread first gets up to ``grace`` s to return what the store already sent
        (a stop the host wrote before it left, buffered while this process was frozen), so that
        ``on_stop`` is told before this returns."""
        self._ended = True
        if grace > 0 and self._watching.is_set():
            self._returned.wait(grace)
        try:
            self._b.close()
        except Exception:
            pass

    def _seen(self, value: bytes | None) -> bool:
        reason = stop_reason_of(value)
        if reason is not None and self._on_stop is not None:
            self._on_stop(reason)
        return True

    def wait(self, timeout: float) -> bool:
        """True once the round must be replaced; False after ``timeout`` s or when closed."""
        deadline = time.monotonic() + timeout
        if self._ended:
            return True
        self._returned.clear()
        self._watching.set()
        try:
            rev = self._b.revision()
            value = self._b.get(self._key)
            if value is not None:
                return self._seen(value)
            while (left := deadline - time.monotonic()) > 0:
                event = self._b.watch(self._key, rev, min(left, self.slice))
                if event is not None and event.key == self._key and event.kind == "set":
                    return self._seen(event.value)  # before end(): what the store sent first
                if self._ended:
                    return True
                if event is not None:
                    rev = event.version
            return False
        except WatchCompactedError:
            value = self._b.get(self._key)
            return value is not None and self._seen(value)
        except StoreNetworkError as exc:
            if self._ended:
                return True
            if self._closed:  # close() ended the wait
                return False
            if self._on_lost is None:
                raise
            self._watching.clear()  # (on_lost ends this watch: no grace to wait for)
            self._on_lost(exc)
            return True
        finally:
            self._watching.clear()
            self._returned.set()

    def close(self) -> None:
        self._closed = True
        try:
            self._b.close()
        except Exception:
            pass


class EndedWatch:
    """A round watch whose round is over already (its store's host was lost)."""

    def wait(self, timeout: float) -> bool:
        return True

    def close(self) -> None:
        return None


def wait_alone(backend: StoreBackend, alive_prefix: str, me: str, timeout: float,
               interrupted: Callable[[], bool], on_wait: Callable[[list[str]], None]) -> list[str]:
    """Waits until no liveness key but ``me``'s is left under ``alive_prefix`` (every other node
    stopped, or was lost: a dead session's key vanishes, a silent node's is deleted by its ring
    watcher), at most ``timeout`` s or until ``interrupted()``. ``on_wait(others)`` is called once
    when there is something to wait for. Returns the nodes still there ([]: alone)."""
    deadline = time.monotonic() + timeout
    told = False
    others: list[str] = []
    for _ in range(1 << 20):
        rev = backend.revision()
        others = [k.rsplit("/", 1)[-1] for k in backend.list(alive_prefix)]
        others = [n for n in others if n != me]
        left = deadline - time.monotonic()
        if not others or left <= 0 or interrupted():
            return others
        if not told:
            told = True
            on_wait(others)
        try:
            backend.watch(alive_prefix, rev, min(left, WAIT_SLICE))
        except WatchCompactedError:
            pass  # listed again
    return others
