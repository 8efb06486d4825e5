"""One local worker group: start its workers through the fork server, learn of their exits, stop
them (SIGTERM, then SIGKILL after the shutdown timeout) and everything their trees started.

Every worker leads its own process group (its pid), so ``killpg`` reaches its children
(DataLoader workers included) even after the worker itself exited.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .forkclient import ForkServer, read_status
from .logs import LogRelay, RankDest, say

__all__ = ["Worker", "WorkerGroup", "WorkerSpec", "signal_name"]


def signal_name(code: int) -> str:
    """``exit code 1`` or ``signal SIGKILL`` for an exit code (negative: killed by a signal)."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except OSError:
        return -1


def _stdin() -> int | None:
    """The launcher's stdin, which every worker shares as under torchrun (None: it has none)."""
    try:
        os.fstat(0)
    except OSError:
        return None
    return 0


@dataclass(frozen=True)
class WorkerSpec:
    local_rank: int
    rank: int
    argv: list[str]
    env: dict[str, str]
    kind: str  # "script", "module" (warm start) or "exec"
    error_file: str
    log_dir: str | None  # this worker's attempt directory (None: no log files)
    dest: RankDest | None = None  # --logs-specs: its files (logspecs.py), instead of log_dir's


@dataclass
class Worker:
    spec: WorkerSpec
    pid: int
    status: socket.socket
    started: float
    exit_code: int | None = None
    exited: float | None = None  # monotonic
    exited_wall: float | None = None
    relays: list[LogRelay] = field(default_factory=list)


class WorkerGroup:
    """The workers of one round on this node."""

    def __init__(self, server: ForkServer, clock: Callable[[], float] = time.monotonic) -> None:
        self._server = server
        self._clock = clock
        self.workers: list[Worker] = []

    def start(self, specs: list[WorkerSpec], cwd: str,
              output: Callable[[WorkerSpec, str], tuple[int, LogRelay]]) -> None:
        """``output(spec, stream)``: the descriptor the worker writes ``stream`` to (a pipe or a
        pseudo-terminal) and the relay that reads it (``logs.rank_output``)."""
        for spec in specs:
            os.makedirs(os.path.dirname(spec.error_file), exist_ok=True)
            if os.path.exists(spec.error_file):
                os.unlink(spec.error_file)
            out_w, out_relay = output(spec, "stdout")
            try:
                err_w, err_relay = output(spec, "stderr")
            except BaseException:
                os.close(out_w)
                raise
            try:
                pid, status = self._server.start(
                    spec.argv, spec.env, cwd, spec.kind, out_w, err_w, stdin=_stdin()
                )
            finally:  # the relays end at EOF, also when the worker never started
                os.close(out_w)
                os.close(err_w)
            worker = Worker(spec, pid, status, self._clock())
            worker.relays = [out_relay, err_relay]
            self.workers.append(worker)

    def register(self, sel: selectors.BaseSelector) -> None:
        for w in self.workers:
            if w.exit_code is None:
                sel.register(w.status, selectors.EVENT_READ, w)

    def collect(self, worker: Worker, sel: selectors.BaseSelector | None = None) -> None:
        """Reads ``worker``'s exit status (its status socket is readable)."""
        code = read_status(worker.status)
        if sel is not None:
            sel.unregister(worker.status)
        worker.status.close()
        worker.exit_code = -signal.SIGKILL if code is None else code
        worker.exited = self._clock()
        worker.exited_wall = time.time()

    def running(self) -> list[Worker]:
        return [w for w in self.workers if w.exit_code is None]

    def send(self, sig: int) -> None:
        for w in self.workers:
            try:
                os.killpg(w.pid, sig)
            except OSError:  # the group is empty
                pass

    def describe(self) -> str:
        """The exit of each worker and what is left in its process group."""
        parts = []
        for w in self.workers:
            code = "running" if w.exit_code is None else signal_name(w.exit_code)
            left = [p for p in _pids() if _pgid(p) == w.pid]
            parts.append(f"rank {w.spec.rank}: {code}, {len(left)} left in its group {left[:5]}")
        return "; ".join(parts)

    def _groups_alive(self) -> bool:
        for w in self.workers:
            try:
                os.killpg(w.pid, 0)
                return True
            except OSError:
                pass
        return False

    def _wait(self, deadline: float) -> bool:
        """Collects exits until every worker and its group is gone or ``deadline``."""
        with selectors.DefaultSelector() as sel:
            self.register(sel)
            for _ in range(1_000_000):
                now = self._clock()
                running = self.running()
                if not running and not self._groups_alive():
                    return True
                if now >= deadline:
                    return False
                if not running:  # only leftovers of a tree: check again shortly
                    time.sleep(min(0.01, deadline - now))
                    continue
                for key, _ in sel.select(min(0.05, deadline - now)):
                    self.collect(key.data, sel)
        return False

    def stop(self, timeout: float, sig: int = signal.SIGTERM) -> None:
        """``sig`` to every worker's group, SIGKILL to what is left after ``timeout`` s."""
        if sig != signal.SIGKILL:
            self.send(sig)
            if self._wait(self._clock() + timeout):
                self._close_relays()
                return
        self.send(signal.SIGKILL)
        self._wait(self._clock() + 10.0)
        self._close_relays()

    def stop_reporting(self, timeout: float, sig: int, exited: Callable[[Worker], None]) -> list[Worker]:
        """:meth:`stop`, then ``exited(worker)`` for each worker that was running and exited;
        returns those workers. Says so when stopping took over a second."""
        t0 = self._clock()
        running = self.running()
        self.stop(timeout, sig)
        for worker in running:
            if worker.exit_code is not None:
                exited(worker)
        if self._clock() - t0 > 1.0:
            say(f"[elasticstore-run] stopping the workers took {self._clock() - t0:.1f}s "
                f"({self.describe()})")
        return running

    def _close_relays(self) -> None:
        for w in self.workers:
            for r in w.relays:
                r.join(2.0)
            if w.exit_code is None:
                w.status.close()
