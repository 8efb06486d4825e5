"""Simulated nodes as processes (``rdzv_node.py``), each on its own loopback address: their
JSON event lines are read by a thread per process; every process is killed by pid and reaped at
the end of the ``Agents`` context (the test checks none is left)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from paths import program

READY_WITHIN = 120.0  # s for an agent process to import torch and make its handler (a loaded host)
AGENT = program("rdzv_node.py")


class Agent:
    def __init__(self, cfg: dict[str, Any], prefix: list[str] | None = None) -> None:
        """``prefix``: a command the agent runs under (e.g. ``ip netns exec NS``)."""
        self.cfg = cfg
        self.addr = cfg["addr"]
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, AGENT, json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stderr: list[str] = []
        self._threads = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._read_err, daemon=True)]
        for thread in self._threads:
            thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                pass

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def expect(self, ev: str, timeout: float = 30.0) -> dict[str, Any]:
        """The next event named ``ev`` (earlier other events are skipped, errors raise)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"{self.addr}: no {ev!r} within {timeout}s; stderr:\n{''.join(self.stderr)[-3000:]}"
                )
            try:
                event = self.events.get(timeout=remaining)
            except queue.Empty:
                continue
            if event["ev"] == ev:
                return event
            if event["ev"] == "error" and ev != "error":
                raise AssertionError(f"{self.addr}: {event}; stderr:\n{''.join(self.stderr)[-3000:]}")

    def go(self) -> None:
        """Lets a gated agent go on (one line on its stdin)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def release(self) -> None:
        """Lets an agent in "stay" mode shut down."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def close_pipes(self) -> None:
        for thread in self._threads:
            thread.join(timeout=5)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()

    def freeze(self) -> float:
        """SIGSTOP: the node goes silent without closing a socket (as when cut off or powered
        off: no FIN, no keep-alive). Returns the wall time."""
        t = time.time()
        os.kill(self.proc.pid, signal.SIGSTOP)
        return t

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> float:
        """SIGKILL; returns the wall time of the kill."""
        t = time.time()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        return t


class Agents:
    """Starts agents with a common configuration; kills and reaps them all on exit."""

    def __init__(self, **common: Any) -> None:
        self.common = common
        self.agents: list[Agent] = []

    def start(self, addr: str, **overrides: Any) -> Agent:
        agent = Agent({**self.common, "addr": addr, **overrides})
        self.agents.append(agent)
        return agent

    def start_together(self, addrs: list[str], per: dict[str, dict[str, Any]] | None = None,
                       before_go: Callable[[], None] | None = None,
                       **overrides: Any) -> list[Agent]:
        """Starts agents that all begin the rendezvous once every one of them is ready (their
        torch imports take seconds), so they meet in the same first round."""
        per = per or {}
        started = [self.start(a, **{"gate": True, **overrides, **per.get(a, {})}) for a in addrs]
        for agent in started:
            agent.expect("ready", READY_WITHIN)
        if before_go is not None:
            before_go()
        for agent in started:
            agent.go()
        return started

    def __enter__(self) -> Agents:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for agent in self.agents:
            agent.release()
        deadline = time.monotonic() + 10
        for agent in self.agents:
            try:
                agent.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                agent.proc.kill()
                agent.proc.wait(timeout=10)
        for agent in self.agents:
            agent.close_pipes()
        assert all(a.proc.poll() is not None for a in self.agents), "an agent was left running"
