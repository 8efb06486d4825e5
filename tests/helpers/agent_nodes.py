"""Agents as real processes for the agent tests: each simulated node on its own 127.0.0.x, its
own session (so a test can kill an agent alone), cleaned up by pid; helpers to wait on the files
``agent_train.py`` writes."""

from __future__ import annotations

import functools
import glob
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from paths import program

TRAIN = program("agent_train.py")


PORT_BLOCK = 2000  # ports per xdist worker, below the kernel's ephemeral range
PORT_BASE = 20000
_next_port = itertools.count(random.randrange(PORT_BLOCK))  # two sessions at once: apart


@functools.cache  # read once per process
def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.2") -> int:
    """A port free on ``host`` now, for a server the test starts next. A port the kernel picks
    (a bind to port 0) comes from the ephemeral range, where any outgoing connection on the
    machine may take it as its own port before that server binds (EADDRINUSE: a test of another
    xdist worker connecting at that moment): so it comes from a block of ports below that range
    that belongs to this xdist worker, in turn from a random start, a port still held (a
    listener, a connection in TIME_WAIT) skipped; the kernel's pick only where that range leaves
    no room."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    base = PORT_BASE + index * PORT_BLOCK
    if base + PORT_BLOCK <= _ephemeral_low():
        for _ in range(PORT_BLOCK):
            port = base + next(_next_port) % PORT_BLOCK
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Agents:
    def __init__(self, workdir: str) -> None:
        self.dir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, flags: list[str], script_args: list[str] | None = None, name: str = "agent",
              env: dict[str, str] | None = None, script: str = TRAIN,
              module: str = "elasticstore.run", stdin: int | None = None,
              interpreter_options: tuple[str, ...] = (),
              prefix: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
        out = open(os.path.join(self.dir, f"{name}.out"), "wb")
        args = ["--dir", self.dir] if script_args is None else script_args
        proc = subprocess.Popen(
            [*prefix, sys.executable, *interpreter_options, "-m", module, *flags, script, *args],
            stdout=out, stderr=subprocess.STDOUT,
            stdin=stdin,
            start_new_session=True, env=dict(os.environ, **(env or {})), cwd=self.dir,
        )
        out.close()
        proc.name = name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def output(self, proc: subprocess.Popen[bytes]) -> str:
        with open(os.path.join(self.dir, f"{proc.name}.out"), errors="replace") as f:  # type: ignore[attr-defined]
            return f.read()

    def wait(self, proc: subprocess.Popen[bytes], timeout: float) -> int:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{proc.name} still running after {timeout}s:\n{self.output(proc)}") from None  # type: ignore[attr-defined]

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait(30)
        assert_gone(self.all_pids(), 5.0)

    def cleanup_quiet(self) -> None:
        """Kills the agents and every recorded worker and child (torchrun leaves its workers
        running when its agent is SIGKILLed)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait(30)
        for pid in self.all_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def starts(self) -> list[dict[str, Any]]:
        found = []
        for path in glob.glob(os.path.join(self.dir, "start-*.json")):
            with open(path) as f:
                found.append(json.load(f))
        return found

    def all_pids(self) -> list[int]:
        """The recorded workers and their children (``start-*.json``) that still run as the
        process recorded: a pid whose process started after its record was written names
        another process now (a long run wraps the pid numbers around: another test's server, say),
        and is left out, so that no clean-up waits for it or kills it."""
        pids = []
        for path in glob.glob(os.path.join(self.dir, "start-*.json")):
            written = os.stat(path).st_mtime
            with open(path) as f:
                s = json.load(f)
            for key in ("pid", "child"):
                pid, ticks = s.get(key), s.get(f"{key}_ticks")
                now = start_ticks(pid) if pid is not None else None
                if now is None:
                    continue
                if now == ticks or (ticks is None and _BOOT + now / _TICKS <= written + _SLACK):
                    pids.append(pid)
        return pids

    def inits(self, attempt: int | None = None) -> dict[int, float]:
        """rank -> time past init_process_group (of ``attempt``, or of any attempt)."""
        found = {}
        for path in glob.glob(os.path.join(self.dir, "init-*")):
            _, att, rank = os.path.basename(path).split("-")
            if attempt is None or int(att) == attempt:
                with open(path) as f:
                    found[int(rank)] = float(f.read() or 0)
        return found

    def release(self) -> None:
        open(os.path.join(self.dir, "release"), "w").close()

    def world_ready(self, world: int, after: float = 0.0) -> int | None:
        """An attempt whose ``world`` workers are all past init_process_group after ``after``."""
        starts = self.starts()
        for att in sorted({s["attempt"] for s in starts if s["world"] == world}, reverse=True):
            inits = self.inits(att)
            if len(inits) == world and min(inits.values()) >= after:
                return att
        return None


def events(log_dir: str) -> list[dict[str, Any]]:
    """Every record of every ``events.jsonl`` below ``log_dir`` (an agent's ``--log-dir``)."""
    found = []
    for root, _, files in os.walk(log_dir):
        if "events.jsonl" in files:
            with open(os.path.join(root, "events.jsonl")) as f:
                found += [json.loads(line) for line in f if line.strip()]
    return found


_TICKS = os.sysconf("SC_CLK_TCK")
_SLACK = 5.0  # s: a record without its process's start time: the boot time is known to the second


def _boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise RuntimeError("no btime in /proc/stat")


_BOOT = _boot_time()


def start_ticks(pid: int) -> int | None:
    """When the process now at ``pid`` started, in clock ticks since boot (what names it, with
    its pid: pids are reused); None when none runs there (a zombie included)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def alive(pid: int) -> bool:
    return start_ticks(pid) is not None


def assert_gone(pids: list[int], within: float) -> float:
    """Waits until none of ``pids`` runs; returns how long it took. Each pid is followed as the
    process it names at the call (its start time): one that ends and whose pid a new process
    takes meanwhile counts as gone, and only the processes followed are killed at the end."""
    born = {p: start_ticks(p) for p in pids}

    def running() -> list[int]:
        return [p for p, t in born.items() if t is not None and start_ticks(p) == t]

    start = time.monotonic()
    while time.monotonic() - start < within:
        if not running():
            return time.monotonic() - start
        time.sleep(0.02)
    left = running()
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    raise AssertionError(f"processes still running after {within}s: {left}")


def until(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@contextmanager
def agents(workdir: str) -> Iterator[Agents]:
    a = Agents(workdir)
    try:
        yield a
    finally:
        a.cleanup()


def node_flags(addr: str, port: int, nnodes: str, nproc: int = 2, *extra: str) -> list[str]:
    return ["--nnodes", nnodes, "--nproc-per-node", str(nproc), "--rdzv-endpoint",
            f"127.0.0.2:{port}", "--local-addr", addr, "--rdzv-id", "job", *extra]


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found
