"""Child processes for the tests: started with a task from ``child_tasks.py``, joined with a deadline;
on failure every child is killed and its output shown."""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, Union

import pytest

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child_tasks.py")
ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child_zygote.py")


class ForkedChild:
    """A child forked by this process's zygote (``child_zygote.py``), with the part of
    ``subprocess.Popen``'s interface the tests use: ``pid``, ``args``, ``returncode``, ``poll``,
    ``wait``, ``kill`` and ``communicate`` (its output is read from files once it ended)."""

    stdout = None

    def __init__(self, pid: int, task: str, raw: str, files: dict[str, str]) -> None:
        self.pid, self.args, self._files = pid, [sys.executable, WORKERS, task, raw], files
        self.returncode: int | None = None
        self._killed = False
        self._output: tuple[str, str] | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # ended (and reaped) already
            self._pidfd = None

    def _ended(self, timeout: float) -> bool:
        if self._pidfd is None:
            return True
        ready, _, _ = select.select([self._pidfd], [], [], max(0.0, timeout))
        return bool(ready)

    def _collect(self) -> int:
        if self.returncode is None:
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
            try:
                with open(self._files["rc"]) as f:
                    self.returncode = int(f.read())
            except (OSError, ValueError):  # ended by a signal: no exit code was written
                self.returncode = -signal.SIGKILL if self._killed else -1
        return self.returncode

    def poll(self) -> int | None:
        return self._collect() if self.returncode is not None or self._ended(0) else None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._ended(1e9 if timeout is None else timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._collect()

    def kill(self) -> None:
        if self.poll() is None:
            self._killed = True
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        if self._output is None:
            texts = []
            for key in ("out", "err"):
                try:
                    with open(self._files[key], errors="replace") as f:
                        texts.append(f.read())
                except FileNotFoundError:  # killed before it opened its files
                    texts.append("")
            self._output = (texts[0], texts[1])
            shutil.rmtree(os.path.dirname(self._files["rc"]), ignore_errors=True)
        return self._output


class _Zygote:
    """This process's zygote, started on first use and ended with this process."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def fork(self, task: str, raw: str) -> ForkedChild:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = subprocess.Popen([sys.executable, ZYGOTE], stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, text=True)
                atexit.register(kill_all, [self._proc])
                assert self._proc.stdout is not None and self._proc.stdout.readline() == "ready\n"
            assert self._proc.stdin is not None and self._proc.stdout is not None
            where = tempfile.mkdtemp(prefix="es-child-")
            files = {k: os.path.join(where, k) for k in ("out", "err", "rc")}
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            self._proc.stdin.write(json.dumps({"task": task, "args": json.loads(raw), **files,
                                               "env": env, "cwd": os.getcwd()}) + "\n")
            self._proc.stdin.flush()
            pid = int(self._proc.stdout.readline())
            return ForkedChild(pid, task, raw, files)


_zygote = _Zygote()


def spawn(task: str, *args: Any) -> ForkedChild:
    """Starts ``python child_tasks.py TASK JSON(args)``, forked from a zygote that has imported
    torch already."""
    return _zygote.fork(task, json.dumps(list(args)))


Child = Union[subprocess.Popen[str], ForkedChild]


def kill_all(procs: Sequence[Child]) -> None:
    """Kills the children still running and reaps every child (closing its pipes)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        if isinstance(proc, ForkedChild):
            proc.communicate(timeout=30)  # its output files are removed
        elif proc.stdout is not None and not proc.stdout.closed:
            proc.communicate(timeout=30)
        proc.wait(timeout=30)


def _describe(procs: Sequence[Child], outputs: list[tuple[str, str]]) -> str:
    parts = []
    for proc, (out, err) in zip(procs, outputs):
        parts.append(
            f"--- {' '.join(map(str, list(proc.args)[2:4]))} exit={proc.returncode}\n"
            f"stdout:\n{out}\nstderr:\n{err[-4000:]}"
        )
    return "\n".join(parts)


def join(procs: Sequence[Child], timeout: float = 60.0) -> list[Any]:
    """Waits for every child (all within ``timeout`` seconds); returns their JSON results."""
    deadline = time.monotonic() + timeout
    outputs: list[tuple[str, str]] = []
    try:
        for proc in procs:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                outputs.append(proc.communicate(timeout=remaining))
            except subprocess.TimeoutExpired:
                kill_all(procs)
                outputs.append(proc.communicate())
                rest = [p.communicate() for p in procs[len(outputs):]]
                pytest.fail(
                    f"children did not finish within {timeout}s\n"
                    + _describe(procs, outputs + rest)
                )
    finally:
        kill_all(procs)
    if any(proc.returncode != 0 for proc in procs):
        pytest.fail("a child failed\n" + _describe(procs, outputs))
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


def wait_until(condition: Any, timeout: float, what: str, interval: float = 0.01) -> None:
    """Re-checks ``condition()`` until it holds; fails naming ``what`` after ``timeout`` s.

    For state with no event to wait on (server counters, a process's memory), checked against a
    deadline rather than slept on.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@dataclass
class CliServer:
    """An ``elasticstore server`` subprocess and the address it printed."""

    proc: subprocess.Popen[str]
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@contextmanager
def cli_server(*flags: str, stderr: IO[str] | int = subprocess.PIPE) -> Iterator[CliServer]:
    """Runs ``elasticstore server --port 0 FLAGS`` until the block ends (killed and reaped even
    when the test fails); yields once it accepts connections."""
    proc = subprocess.Popen([sys.executable, "-m", "elasticstore.cli", "server", "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once it accepts (bounded by the test's timeout)
        assert line.startswith("elasticstore server listening on "), line
        host, port = line.split()[-1].rsplit(":", 1)
        yield CliServer(proc, host, int(port))
    finally:
        kill_all([proc])  # SIGKILL ends a process the test stopped, too


def closed_by_server(sock: socket.socket, deadline: float = 5.0) -> bool:
    """Reads (discarding any replies) until the server closes; False if it has not by then."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        sock.settimeout(max(0.01, end - time.monotonic()))
        try:
            if sock.recv(65536) == b"":
                return True
        except ConnectionResetError:
            return True
        except socket.timeout:  # TimeoutError from 3.10 on
            return False
    return False
