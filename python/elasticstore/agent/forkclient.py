"""The agent's handle on its fork server (``forkserver.py``, run as a script): start it, ask it
for a worker, read a worker's exit status.

Protocol (AF_UNIX SOCK_SEQPACKET): the agent sends ``{"argv", "env", "cwd", "kind"}`` as JSON with
four descriptors (the worker's status socket, stdin, stdout, stderr); the worker itself writes
``pid N`` on the status socket once it leads its own process group (so the agent can signal the
group from then on), and the server writes ``exit CODE`` (negative: killed by signal -CODE) when
it reaped it.

Before a round the agent may instead send ``{"op": "preload"}`` with one descriptor: the server
replies on it with what it preloaded and refused since the last such request (``PreloadReport``'s
fields as JSON, ``preload.Preloader.report``); what it has not done yet it does when idle again.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from .logs import say

__all__ = ["ForkServer", "PreloadReport", "read_status", "settle_preloads"]

SERVER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkserver.py")


@dataclass(frozen=True)
class PreloadReport:
    """What the fork server preloaded since the last report and what it refused (and why)."""

    preloaded: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    tainted: str | None = None
    unavailable: int = 0  # submodules not preloaded: ImportError (an optional dependency missing)
    submodules: int = 0  # preloaded submodules of the packages in ``preloaded``
    # preloaded although its import looked up worker variables (unset in the fork server)
    env_reads: dict[str, list[str]] = field(default_factory=dict)  # the server is no longer safe to fork (and forks no more)


class ForkServer:
    """The agent's handle on the server process. ``preload``: warm start (fork server with torch
    imported); otherwise every worker is a fresh ``exec``. ``learn`` (warm start only): the
    server also preloads the third-party packages its workers imported; ``refused``: packages it
    must never preload (name -> why)."""

    def __init__(self, preload: bool, learn: bool = True,
                 refused: dict[str, str] | None = None) -> None:
        self.preload = preload
        self._forked = False  # whether a worker was ever asked for
        self.learn = learn and preload
        self.refused = dict(refused or {})
        self._ctl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mode = "--preload" if preload else "--plain"
        options = json.dumps({"learn": self.learn, "refused": self.refused})
        self.proc = subprocess.Popen(
            [sys.executable, SERVER_SCRIPT, mode, str(theirs.fileno()), str(os.getpid()), options],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()

    @property
    def control(self) -> socket.socket:
        """Readable only when the server died (it never writes on it)."""
        return self._ctl

    def start(self, argv: list[str], env: dict[str, str], cwd: str, kind: str,
              stdout: int, stderr: int, timeout: float = 300.0,
              stdin: int | None = None, check: bool = False) -> tuple[int, socket.socket]:
        """Starts a worker; returns its pid (== its process group) and its status socket.
        ``stdin``: the worker's standard input (None: /dev/null). ``check``: a health check's
        process, contained as a worker, which leaves the server's idle work (the deferred
        preload) waiting for the first real worker."""
        self._forked = True
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        null = os.open(os.devnull, os.O_RDONLY) if stdin is None else -1
        try:
            job = {"argv": argv, "env": env, "cwd": cwd, "kind": kind, "check": check}
            msg = json.dumps(job).encode()
            fd_in = null if stdin is None else stdin
            socket.send_fds(self._ctl, [msg], [theirs.fileno(), fd_in, stdout, stderr])
        finally:
            theirs.close()
            if null >= 0:
                os.close(null)
        mine.settimeout(timeout)  # the first start waits for the preload (import torch)
        reply = mine.recv(256).decode()
        mine.settimeout(None)
        if not reply.startswith("pid "):
            mine.close()
            raise RuntimeError(f"fork server: could not start {argv[:2]}: {reply or 'it died'}")
        return int(reply[4:]), mine

    def preloads(self, timeout: float = 600.0) -> PreloadReport | None:
        """What the server preloaded and refused since the last call (None: it did not
        answer); it never waits for an import in progress (its stand-in answers then)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            socket.send_fds(self._ctl, [json.dumps({"op": "preload"}).encode()], [theirs.fileno()])
            theirs.close()
            mine.settimeout(timeout)
            msg: dict[str, Any] = json.loads(mine.recv(1 << 20) or b"null") or {}
        except (OSError, ValueError):
            return None
        finally:
            theirs.close()
            mine.close()
        if not msg:
            return None
        report = PreloadReport(
            preloaded=[str(n) for n in msg.get("preloaded", [])],
            refused={str(k): str(v) for k, v in msg.get("refused", {}).items()},
            seconds=float(msg.get("seconds", 0.0)), tainted=msg.get("tainted"),
            unavailable=int(msg.get("unavailable", 0)), submodules=int(msg.get("submodules", 0)),
            env_reads={str(k): [str(x) for x in v] for k, v in msg.get("env_reads", {}).items()})
        self.refused.update(report.refused)
        return report

    def wait_warm(self, timeout: float = 600.0) -> bool:
        """Blocks until the server has imported what it preloads for every worker (torch), so
        that a worker could be forked at once; False: it died or did not answer in time."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            socket.send_fds(self._ctl, [json.dumps({"op": "ready"}).encode()], [theirs.fileno()])
            theirs.close()
            mine.settimeout(timeout)
            return mine.recv(16) == b"ready"
        except OSError:
            return False
        finally:
            theirs.close()
            mine.close()

    def replacement(self) -> ForkServer:
        """A fresh server with the same settings, refusing what this one refused."""
        return ForkServer(self.preload, self.learn, self.refused)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, timeout: float = 10.0) -> None:
        """The server kills what is left of every worker's tree and exits. A server that never
        forked has nothing to clean up: it is killed at once, not awaited (it may still be
        importing torch for seconds, as when a signal ends the job in its first rendezvous)."""
        self._ctl.close()
        if not self._forked:
            self.proc.kill()
            self.proc.wait(5)
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def read_status(sock: socket.socket) -> int | None:
    """The exit code from a worker's status socket (None: the server died first)."""
    try:
        data = sock.recv(256).decode()
    except OSError:
        return None
    return int(data[5:]) if data.startswith("exit ") else None


def settle_preloads(server: ForkServer, events: Any) -> ForkServer:
    """Before a round's workers are forked: the server finishes preloading what the last
    round's workers imported; says what was preloaded and refused (a console line and a
    ``preload`` event). A server that is no longer safe to fork is replaced by a fresh one (its
    refusals carried over): the fresh one pays ``import torch`` once more before this round, and
    learns the packages again from this round's workers."""
    if not server.learn or not server.alive():
        return server
    report = server.preloads()
    if report is None or not (report.preloaded or report.submodules or report.refused
                              or report.tainted):
        return server
    packages, submodules = report.preloaded, report.submodules
    if packages or submodules:
        more = f" and {submodules} submodule(s) of those" if submodules else ""
        skipped = (f"; {report.unavailable} submodule(s) skipped (ImportError: an optional "
                   "dependency is missing)") if report.unavailable else ""
        say(f"[elasticstore-run] preloaded for this round: {', '.join(packages) or '-'}{more} "
            f"({report.seconds:.1f}s){skipped}")
    for name, variables in report.env_reads.items():
        say(f"[elasticstore-run] preloaded {name}, whose import looks up {', '.join(variables)}: "
            "it saw the fork server's environment, where they are unset (--no-preload-imports "
            "if it matters)")
    for name, why in report.refused.items():
        say(f"[elasticstore-run] not preloaded: {name}: {why}")
    events.emit("preload", preloaded=packages, submodules=submodules, refused=report.refused,
                unavailable=report.unavailable, env_reads=report.env_reads,
                seconds=report.seconds, tainted=report.tainted)
    if report.tainted is None:
        return server
    say(f"[elasticstore-run] the fork server is not safe to fork any more ({report.tainted}): "
        "starting a fresh one")
    server.close()
    return server.replacement()
