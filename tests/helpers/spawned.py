"""Child processes for the tests: started with a task from ``child_tasks.py``, joined with a deadline;
on failure every child is killed and its output shown."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

import pytest

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child_tasks.py")


def spawn(task: str, *args: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, WORKERS, task, json.dumps(list(args))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def kill_all(procs: list[subprocess.Popen[str]]) -> None:
    """Kills the children still running and reaps every child (closing its pipes)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        if proc.stdout is not None and not proc.stdout.closed:
            proc.communicate(timeout=30)
        proc.wait(timeout=30)


def _describe(procs: list[subprocess.Popen[str]], outputs: list[tuple[str, str]]) -> str:
    parts = []
    for proc, (out, err) in zip(procs, outputs):
        parts.append(
            f"--- {' '.join(proc.args[2:4])} exit={proc.returncode}\n"
            f"stdout:\n{out}\nstderr:\n{err[-4000:]}"
        )
    return "\n".join(parts)


def join(procs: list[subprocess.Popen[str]], timeout: float = 60.0) -> list[Any]:
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
