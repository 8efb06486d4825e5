"""One health check of this node (``health.py`` decides when): its processes, started through the
agent's fork server and contained as its workers are (each leads its own process group, dies with
the fork server, which dies with the agent), bounded in time, interrupted by a signal.

- The default check: ``nproc`` processes of ``healthcheck.py`` (a gloo ``all_reduce`` among them
  and timed matmuls in each); warm start forks them from the fork server (torch is imported
  there: the check costs ~0.1-0.5 s), plain start runs ``python -u healthcheck.py``.
- ``--health-check-cmd``: ``/bin/sh -c CMD``, one process; exit 0 is healthy.

The time limit counts from the fork server being warm (its ``import torch``, which the node's
first round waits for anyway, is not the check's) to the last process's exit; when it is up, or
when one process fails (the others would wait for it in gloo), every process left is killed
(SIGKILL to its group). A signal on ``sig_r`` kills them too and is returned at once.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .config import HealthSettings
from .forkclient import ForkServer, read_status
from .healthcheck import MARK
from .workers import signal_name

__all__ = ["CHECK_SCRIPT", "CheckResult", "run_check"]

CHECK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "healthcheck.py")
REAP_S = 2.0  # how long to wait for the exit of a process killed with SIGKILL
TAIL_LINES = 3  # lines of a failed process's output in the reason
TAIL_CHARS = 400


@dataclass
class CheckResult:
    ok: bool
    reason: str  # why it failed; "" when ok
    seconds: float  # from warm to the last exit
    warm_wait: float  # waiting for the fork server to be warm (its import of torch)
    detail: dict[str, Any] = field(default_factory=dict)  # per-rank times (default check)
    pids: list[int] = field(default_factory=list)  # the check's processes (all gone by now)


@dataclass
class _Proc:
    name: str  # "local rank N" or the command
    pid: int
    status: socket.socket
    out: str  # its stdout and stderr
    code: int | None = None


class _Starter:
    """Asks the fork server for the check's processes in a thread of its own (a fork waits for
    the server's ``import torch``, or for an import it does when idle), so the agent's thread
    stays free for signals and the time limit. Writes ``w`` on ``ready`` once the server is
    warm and ``x`` when done."""

    def __init__(self, server: ForkServer, jobs: list[tuple[str, list[str], str, str]],
                 env: dict[str, str], cwd: str) -> None:
        self.procs: list[_Proc] = []
        self.error: str | None = None
        self.lock = threading.Lock()
        self.abandoned = False
        self.ready, ready_w = socket.socketpair()

        def target() -> None:
            try:
                if not server.wait_warm():
                    raise RuntimeError("the fork server did not start")
                ready_w.send(b"w")
                for name, argv, kind, out in jobs:
                    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                    try:
                        pid, status = server.start(argv, env, cwd, kind, fd, fd, check=True)
                    finally:
                        os.close(fd)
                    with self.lock:
                        if self.abandoned:  # too late: the agent stopped waiting for it
                            _kill(pid)
                            status.close()
                            break
                        self.procs.append(_Proc(name, pid, status, out))
            except (RuntimeError, OSError) as exc:
                self.error = str(exc) or type(exc).__name__
            finally:
                try:
                    ready_w.send(b"x")
                except OSError:
                    pass
                ready_w.close()

        self.thread = threading.Thread(target=target, name="health-check", daemon=True)
        self.thread.start()

    def abandon(self) -> list[_Proc]:
        """No more processes: kills those started; returns them."""
        with self.lock:
            self.abandoned = True
            for p in self.procs:
                if p.code is None:
                    _kill(p.pid)
            return list(self.procs)


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def _jobs(s: HealthSettings, nproc: int, warm: bool, tmp: str) -> list[tuple[str, list[str], str, str]]:
    """(name, argv, kind, output file) of each process of the check."""
    if s.command is not None:
        return [(repr(s.command), ["/bin/sh", "-c", s.command], "exec", os.path.join(tmp, "out"))]
    jobs = []
    for rank in range(nproc):
        args = [CHECK_SCRIPT, "--store", os.path.join(tmp, "store"), "--rank", str(rank),
                "--world", str(nproc), "--timeout", repr(s.timeout), "--size", str(s.matmul_size),
                "--reps", str(s.matmul_reps)]
        argv, kind = (args, "script") if warm else ([sys.executable, "-u", *args], "exec")
        jobs.append((f"local rank {rank}", argv, kind, os.path.join(tmp, f"out-{rank}")))
    return jobs


def _tail(path: str) -> str:
    """The last lines of a process's output, as one line."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 16384))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(MARK)]
    tail = " | ".join(lines[-TAIL_LINES:])
    return tail if len(tail) <= TAIL_CHARS else "..." + tail[-TAIL_CHARS:]


def _report(path: str) -> dict[str, Any] | None:
    try:
        with open(path, errors="replace") as f:
            for line in f:
                if line.startswith(MARK):
                    obj = json.loads(line[len(MARK):])
                    return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        pass
    return None


def _judge(s: HealthSettings, procs: list[_Proc]) -> tuple[str, dict[str, Any]]:
    """(reason, detail) once every process exited 0 (reason "": healthy)."""
    if s.command is not None:
        return "", {}
    reports = [_report(p.out) for p in procs]
    missing = [p.name for p, r in zip(procs, reports) if r is None]
    if missing:
        return f"{missing[0]} exited 0 without its report", {}
    rows = [r for r in reports if r is not None]

    def spread(key: str) -> list[float]:
        return [round(min(float(r[key]) for r in rows), 3), round(max(float(r[key]) for r in rows), 3)]

    detail = {"processes": len(rows), "matmul_ms": spread("matmul_ms"),
              "all_reduce_ms": spread("all_reduce_ms"), "init_ms": spread("init_ms")}
    slowest = max(rows, key=lambda r: float(r["matmul_ms"]))
    if s.max_matmul_ms and float(slowest["matmul_ms"]) > s.max_matmul_ms:
        return (f"local rank {slowest['rank']}: a {s.matmul_size}x{s.matmul_size} matmul took "
                f"{float(slowest['matmul_ms']):.1f} ms (median of {s.matmul_reps}; limit "
                f"{s.max_matmul_ms:g} ms, --health-check-max-matmul-ms)"), detail
    return "", detail


def _failure(p: _Proc) -> str:
    assert p.code is not None
    how = signal_name(p.code)
    tail = _tail(p.out)
    return f"{p.name} failed with {how}" + (f": {tail}" if tail else "")


def run_check(server: ForkServer, s: HealthSettings, nproc: int, env: dict[str, str],
              sig_r: socket.socket, clock: Callable[[], float] = time.monotonic) -> CheckResult | int:
    """Runs one check; its result, or the number of a signal that came on ``sig_r`` first (the
    check's processes are then killed). Every process of the check is gone when it returns."""
    tmp = tempfile.mkdtemp(prefix="elasticstore_health_")
    starter = _Starter(server, _jobs(s, nproc, server.preload, tmp), env, os.getcwd())
    try:
        result = _follow(starter, server, s, sig_r, clock)
    finally:
        procs = starter.abandon()
        starter.thread.join(REAP_S)  # a process it starts from now on is killed at once
        _reap(procs)
        starter.ready.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(result, CheckResult):
        result.pids = [p.pid for p in procs]
    return result


def _follow(starter: _Starter, server: ForkServer, s: HealthSettings, sig_r: socket.socket,
          clock: Callable[[], float]) -> CheckResult | int:
    """Waits for the server to be warm, the processes to start and then to exit."""
    start = clock()
    warm_at: float | None = None
    started = False
    procs: list[_Proc] = []
    with selectors.DefaultSelector() as sel:
        sel.register(starter.ready, selectors.EVENT_READ, "ready")
        sel.register(sig_r, selectors.EVENT_READ, "signal")
        sel.register(server.control, selectors.EVENT_READ, "server")
        watched: set[int] = set()
        for _ in range(1 << 30):
            if started:
                with starter.lock:
                    procs = list(starter.procs)
                for p in procs:
                    if p.pid not in watched:
                        watched.add(p.pid)
                        sel.register(p.status, selectors.EVENT_READ, p)
                failed = [p for p in procs if p.code not in (None, 0)]
                if failed or starter.error:
                    why = _failure(failed[0]) if failed else f"could not start: {starter.error}"
                    return _fail(why, start, warm_at, clock)
                if all(p.code is not None for p in procs):  # started: the list is final
                    reason, detail = _judge(s, procs)
                    return CheckResult(not reason, reason, clock() - (warm_at or start),
                                       (warm_at or start) - start, detail)
            left = None if warm_at is None else warm_at + s.timeout - clock()
            if left is not None and left <= 0:
                running = [p.name for p in starter.procs if p.code is None]
                what = f" ({', '.join(running)} still running)" if running else ""
                return _fail(f"timed out after {s.timeout:g}s{what}", start, warm_at, clock)
            for key, _ in sel.select(left):
                if key.data == "signal":
                    starter.abandon()
                    return int(sig_r.recv(64)[0])
                if key.data == "server":
                    return _fail("the fork server died", start, warm_at, clock)
                if key.data == "ready":
                    data = starter.ready.recv(16)
                    if b"w" in data:
                        warm_at = clock()
                    if b"x" in data or not data:
                        started = True
                        sel.unregister(starter.ready)
                    continue
                proc: _Proc = key.data
                proc.code = read_status(proc.status)
                if proc.code is None:  # the server died first
                    proc.code = -signal.SIGKILL
                sel.unregister(proc.status)
    return _fail("the check's wait gave up", start, warm_at, clock)


def _fail(reason: str, start: float, warm_at: float | None,
          clock: Callable[[], float]) -> CheckResult:
    now = clock()
    return CheckResult(False, reason, now - (warm_at or start), (warm_at or now) - start)


def _reap(procs: list[_Proc]) -> None:
    """Waits (at most ``REAP_S``) for the exit of every process (killed already) and closes
    their status sockets: none is left behind when the check returns."""
    deadline = time.monotonic() + REAP_S
    for p in procs:
        if p.code is None:
            p.status.settimeout(max(0.0, deadline - time.monotonic()))
            try:
                p.code = read_status(p.status)
            except OSError:
                pass
        p.status.close()
