"""Processes the benchmarks start: store servers (each in its own process) and forked clients,
all killed on exit, Ctrl-C, SIGTERM or failure (children also carry PR_SET_PDEATHSIG); a
server's data directory, if it has one, is removed with it."""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

HOST = "127.0.0.1"  # all traffic stays on loopback
HERE = os.path.dirname(os.path.abspath(__file__))

# ----------------------------------------------------------------------------------- processes

_SERVERS: list["ServerProc"] = []
_CHILDREN: set[int] = set()


def set_pdeathsig() -> None:
    """The calling process gets SIGKILL when its parent dies (no orphans after a crash)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def cleanup() -> None:
    """Kills every child and server this process started. Idempotent."""
    for pid in list(_CHILDREN):
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        _CHILDREN.discard(pid)
    for srv in list(_SERVERS):
        srv.close()


_MAIN_PID = os.getpid()


def _on_exit() -> None:
    if os.getpid() == _MAIN_PID:
        cleanup()


atexit.register(_on_exit)


def _on_sigterm(signum, frame):  # turn SIGTERM into a normal exit so finally/atexit run
    raise SystemExit(128 + signum)


def install_sigterm_handler() -> None:
    """Called by report.py and conftest.py (the measuring process), not by server hosts."""
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread
        pass


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """On-CPU time of every live thread of pid (/proc/PID/task/*/schedstat, nanoseconds)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total / 1e9


def pin_threads(pid: int, cpus: set) -> None:
    """Pins every thread of pid to cpus (sched_setaffinity on a pid moves only its main
    thread); threads created later inherit the pinning of their creator."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass  # the thread ended meanwhile


@dataclass
class ServerProc:
    """A store server running in its own process."""

    host: str
    port: int
    proc: subprocess.Popen
    what: str
    out: Any = None  # temporary files holding its stdout and stderr
    err: Any = None
    data_dir: Optional[str] = None  # removed on close

    def stdout_tail(self, n: int = 2000) -> str:
        return _tail(self.out, n)

    def stderr_tail(self, n: int = 2000) -> str:
        return _tail(self.err, n)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server process so far (all its threads)."""
        return cpu_seconds(self.proc.pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
            except OSError:
                pass
            self.proc.terminate()
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.out, self.err):
            try:
                if f:
                    f.close()
            except OSError:
                pass
        if self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        if self in _SERVERS:
            _SERVERS.remove(self)


def _tail(f, n: int) -> str:
    try:
        f.seek(0)
        return f.read().decode(errors="replace")[-n:]
    except (OSError, ValueError, AttributeError):
        return ""


def spawn(argv: list[str], what: str, port: int = 0, data_dir: Optional[str] = None) -> ServerProc:
    """Starts argv as a server process (registered for cleanup). Output goes to temporary files
    (a pipe nobody reads would block a chatty server)."""
    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=out, stderr=err, preexec_fn=set_pdeathsig,
            cwd="/",  # never import a source tree by accident
        )
    except BaseException:
        out.close()
        err.close()
        if data_dir:
            shutil.rmtree(data_dir, ignore_errors=True)
        raise
    srv = ServerProc(HOST, port, proc, what, out, err, data_dir)
    _SERVERS.append(srv)
    return srv


def wait_ready(srv: ServerProc, ready: Callable[[ServerProc], bool], expect: str,
               timeout: float) -> ServerProc:
    """Polls ready(srv) until it is true; closes the server and raises when it exits first or
    the timeout passes."""
    deadline = time.monotonic() + timeout
    try:
        while not ready(srv):
            if time.monotonic() > deadline or srv.proc.poll() is not None:
                raise RuntimeError(f"{srv.what}: {expect} (exit {srv.proc.poll()}); stdout "
                                   f"{srv.stdout_tail(500)!r}; stderr {srv.stderr_tail()!r}")
            time.sleep(0.02)
    except BaseException:
        srv.close()
        raise
    return srv


def _listening(srv: ServerProc) -> bool:
    """Takes HOST:PORT from a "... listening on HOST:PORT" line of the server's stdout."""
    line = next((x for x in srv.stdout_tail(1 << 16).splitlines() if "listening on" in x), None)
    if line is None:
        return False
    host, port = line.strip().rsplit(" ", 1)[-1].rsplit(":", 1)
    srv.host = host.strip("[]")
    srv.port = int(port)
    return True


def start_server_process(argv: list[str], what: str, timeout: float = 60.0) -> ServerProc:
    """Starts argv, waits for "... listening on HOST:PORT" on its stdout."""
    return wait_ready(spawn(argv, what), _listening, "no 'listening on' line", timeout)
