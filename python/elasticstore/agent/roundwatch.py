"""The round watch: a thread that wakes the agent's wait point once the rendezvous says the
round must be replaced. It blocks in the handler's ``watch_round()`` watch: with elasticstore's
handler a store watch (the news arrives at once); with any other handler, adapted by
``rendezvous.api``, a poll of ``num_nodes_waiting()`` every ``--monitor-interval``."""

from __future__ import annotations

import socket
import threading

from ..rendezvous.api import AgentRendezvous, RoundWatchLike
from .logs import say

__all__ = ["ROUND_WATCH_SLICE", "RoundWatcher"]

# Seconds of one blocking watch on the round (``stop()`` ends it at once by closing its
# connection). Long, so a watch is nearly always waiting in the server: the news that ends the
# round (e.g. ``elasticstore stop``) reaches this node even when its store is gone right after.
ROUND_WATCH_SLICE = 60.0


class RoundWatcher:
    """A thread that writes to ``wake`` once the handler says the round must be replaced."""

    def __init__(self, handler: AgentRendezvous, wake: socket.socket) -> None:
        self._h, self._wake = handler, wake
        self._stop = threading.Event()
        self._watch: RoundWatchLike | None = None
        self._thread = threading.Thread(target=self._run, name="round-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._watch = watch = self._h.watch_round()
            if watch is not None and self._stop.is_set():
                watch.close()
            for _ in range(1 << 40):
                if self._stop.is_set() or watch is None:
                    return
                if watch.wait(ROUND_WATCH_SLICE):
                    self._notify()
                    return
        except Exception as exc:
            if not self._stop.is_set():
                say(f"[elasticstore-run] watching the round failed: {exc}")

    def _notify(self) -> None:
        if not self._stop.is_set():
            self._wake.send(b"r")

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.close()
        self._thread.join(2.0)
