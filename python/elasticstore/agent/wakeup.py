"""The agent's one wait point for signals: the signals it handles are caught by a no-op handler
and written, through ``signal.set_wakeup_fd``, to a socket pair whose read end the agent's waits
select on (the rendezvous call, the worker watch, the health gate). Closing restores what was
there before."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["SignalWakeup"]


class SignalWakeup:
    """While open, the given signals wake ``sock`` (readable, one byte per signal number)."""

    def __init__(self, signals: Iterable[int]) -> None:
        self.sock, self._w = socket.socketpair()
        self.sock.setblocking(False)
        self._w.setblocking(False)
        self.first: tuple[int, float] | None = None  # the first signal and when it came
        self._old: dict[int, Any] = {sig: signal.signal(sig, self._came) for sig in signals}
        self._old_fd = signal.set_wakeup_fd(self._w.fileno())

    def _came(self, sig: int, _frame: Any) -> None:
        if self.first is None:
            self.first = (sig, time.monotonic())

    def grace_left(self, code: int, grace: float) -> float | None:
        """When a signal came and the agent exits with a failure ``code`` (128 + its number, or
        a worker's failure when the signal reached a worker first): the seconds left of ``grace``
        since it came; else None."""
        if self.first is None or code == 0:
            return None
        return self.first[1] + grace - time.monotonic()

    def pending(self) -> bool:
        """Whether a signal came (consumed: the caller gives up what it waits for)."""
        try:
            return bool(self.sock.recv(64))
        except BlockingIOError:
            return False

    def close(self) -> None:
        signal.set_wakeup_fd(self._old_fd)
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._w.close()
        self.sock.close()
