"""The round watch: a thread that wakes the agent's wait point once the rendezvous says the
round must be replaced. With elasticstore's handlers it blocks in ``handler.watch_round()`` (a
store watch: the news arrives at once); with any other torch handler it asks
``num_nodes_waiting()`` every ``--monitor-interval``."""

from __future__ import annotations

import socket
import threading
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler

from .logs import say

__all__ = ["ROUND_WATCH_SLICE", "RoundWatcher"]

# Seconds of one blocking watch on the round (``stop()`` ends it at once by closing its
# connection). Long, so a watch is nearly always waiting in the server: the news that ends the
# round (e.g. ``elasticstore stop``) reaches this node even when its store is gone right after.
ROUND_WATCH_SLICE = 60.0


class RoundWatcher:
    """A thread that writes to ``wake`` once the handler says the round must be replaced."""

    def __init__(self, handler: RendezvousHandler, interval: float, wake: socket.socket) -> None:
        self._h, self._interval, self._wake = handler, interval, wake
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name="round-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            watch_round = getattr(self._h, "watch_round", None)
            if watch_round is None:  # another handler: ask it every monitor interval
                while not self._stop.wait(self._interval):
                    if self._h.num_nodes_waiting() > 0:
                        self._notify()
                        return
                return
            self._watch = watch_round()
            if self._stop.is_set():
                self._watch.close()
            for _ in range(1 << 40):
                if self._stop.is_set() or self._watch is None:
                    return
                if self._watch.wait(ROUND_WATCH_SLICE):
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
