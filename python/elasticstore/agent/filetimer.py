"""torch's file timer for the workers (``torch.distributed.elastic.timer``), as torchrun runs it.

With ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` in the launcher's environment, the agent serves the FIFO
named by ``TORCHELASTIC_TIMER_FILE`` (created; by default ``watchdog_timer_<uuid>`` under the
temporary directory) and passes its path to the workers, whose
``timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))`` then works
unchanged. A request is torch's ``FileTimerRequest`` as one JSON line (``pid``, ``scope_id``,
``expiration_time``, ``signal``; an expiration below 0 releases the scope). When a scope's time
passes, its process gets the request's signal (SIGKILL by default); the agent sees that worker
exit and handles it as any failure (the round ends; a restart, or the report and exit 1).

torchrun's agent runs torch's ``FileTimerServer``, which after killing an expired worker also
kills its own process with the same signal: torchrun exits 137 at once, without a restart and
without stopping the other workers. This server kills the expired process only (docs/agent.md,
"Exit codes and what platforms read").
"""

from __future__ import annotations

import json
import os
import select
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["FileTimerSettings", "WorkerTimers"]

ENABLE_VAR, FILE_VAR = "TORCHELASTIC_ENABLE_FILE_TIMER", "TORCHELASTIC_TIMER_FILE"
POLL_S = 0.1  # torch's agent runs its server with max_interval=0.1
MAX_LINE_BYTES = 64 * 1024  # a request is a short JSON line; a longer one is dropped
MAX_TIMERS = 100_000  # scopes held at once; a request over it is dropped (and said once)
MAX_PID = 1 << 22  # Linux's largest pid_max; a request naming another pid is dropped
MAX_SIGNAL = 64  # SIGRTMAX; 0 (torch's "do not kill") included


@dataclass(frozen=True)
class FileTimerSettings:
    enabled: bool
    path: str | None  # TORCHELASTIC_TIMER_FILE as given (None: not set)
    warning: str | None = None  # a value of the enable variable that torch ignores too

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> FileTimerSettings:
        raw, path = env.get(ENABLE_VAR), env.get(FILE_VAR) or None
        warning = None
        if raw not in (None, "", "0", "1"):
            warning = f"{ENABLE_VAR}={raw!r}: only 1 enables the file timer (as torchrun); it stays off"
        return cls(raw == "1", path, warning)


class WorkerTimers:
    """The FIFO server (a daemon thread); ``env()`` is what the workers get; ``close()`` stops it
    and removes the FIFO."""

    def __init__(self, settings: FileTimerSettings, say: Callable[[str], None]) -> None:
        self._say = say
        self._path = settings.path
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._fds: list[int] = []
        if settings.warning:
            say(f"[elasticstore-run] {settings.warning}")
        if not settings.enabled:
            return
        if self._path is None:
            self._path = os.path.join(tempfile.gettempdir(), f"watchdog_timer_{uuid.uuid4()}")
        self._make_fifo(self._path)
        # The read end first (never blocks with O_NONBLOCK), then a write end of our own, so the
        # read end never sees end-of-file when a worker closes its side.
        self._fds.append(os.open(self._path, os.O_RDONLY | os.O_NONBLOCK))
        self._fds.append(os.open(self._path, os.O_WRONLY | os.O_NONBLOCK))
        self._thread = threading.Thread(target=self._serve, name="file-timer", daemon=True)
        self._thread.start()

    @staticmethod
    def _make_fifo(path: str) -> None:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None:
            if not stat.S_ISFIFO(mode):  # torch removes whatever is there; we refuse
                raise ValueError(f"{FILE_VAR}={path}: exists and is not a FIFO (remove it, or "
                                 f"unset {FILE_VAR} for a fresh one under the temporary directory)")
            os.remove(path)  # a FIFO an earlier agent left (as torch's server does)
        os.mkfifo(path, 0o600)

    def env(self) -> dict[str, str]:
        return {FILE_VAR: self._path} if self._path is not None else {}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5 * POLL_S + 1.0)
            self._thread = None
            try:
                os.remove(self._path or "")
            except OSError:
                pass
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    # -- the thread ---------------------------------------------------------------------------

    def _serve(self) -> None:
        timers: dict[tuple[int, str], tuple[float, int]] = {}  # (pid, scope) -> (expiry, signal)
        pending = b""
        full_said = False
        while not self._stop.is_set():
            ready, _, _ = select.select([self._fds[0]], [], [], POLL_S)
            if ready:
                try:
                    chunk = os.read(self._fds[0], 65536)
                except BlockingIOError:
                    chunk = b""
                pending += chunk
                *lines, pending = pending.split(b"\n")
                if len(pending) > MAX_LINE_BYTES:
                    pending = b""
                for line in lines:
                    request = _parse(line)
                    if request is None:
                        continue
                    pid, scope, expiry, sig = request
                    if expiry < 0:
                        timers.pop((pid, scope), None)
                    elif len(timers) < MAX_TIMERS or (pid, scope) in timers:
                        timers[(pid, scope)] = (expiry, sig)
                    elif not full_said:
                        full_said = True
                        self._say(f"[elasticstore-run] file timer: over {MAX_TIMERS} scopes "
                                  f"held; further ones are not timed")
            self._reap(timers, time.time())

    def _reap(self, timers: dict[tuple[int, str], tuple[float, int]], now: float) -> None:
        expired: dict[int, list[tuple[float, str, int]]] = {}
        for (pid, scope), (expiry, sig) in timers.items():
            if expiry <= now:
                expired.setdefault(pid, []).append((expiry, scope, sig))
        for pid, scopes in expired.items():
            scopes.sort()
            for _, scope, _ in scopes:
                timers.pop((pid, scope), None)
            # As torch's server: the first expired scope (by time) that names a signal.
            named = [(scope, sig) for _, scope, sig in scopes if sig > 0]
            if not named:
                continue
            scope, sig = named[0]
            if pid <= 1 or pid == os.getpid():  # never a process group, init, or the agent
                self._say(f"[elasticstore-run] file timer: scope {scope!r} expired for pid {pid}, "
                          f"which is not killed")
                continue
            self._say(f"[elasticstore-run] file timer: scope {scope!r} expired: killing pid "
                      f"{pid} with signal {sig}")
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
            except OSError as exc:
                self._say(f"[elasticstore-run] file timer: could not kill pid {pid}: {exc}")


def _parse(line: bytes) -> tuple[int, str, float, int] | None:
    """(pid, scope, expiration time, signal) of a request line; None when it is not one."""
    try:
        data = json.loads(line)
        request = (int(data["pid"]), str(data["scope_id"]), float(data["expiration_time"]),
                   int(data["signal"]))
    except (ValueError, KeyError, TypeError):
        return None
    pid, _, _, sig = request
    return request if 0 < pid <= MAX_PID and 0 <= sig <= MAX_SIGNAL else None
