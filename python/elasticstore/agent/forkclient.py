"""The agent's handle on its fork server (``forkserver.py``, run as a script): start it, ask it
for a worker, read a worker's exit status.

Protocol (AF_UNIX SOCK_SEQPACKET): the agent sends ``{"argv", "env", "cwd", "kind"}`` as JSON with
four descriptors (the worker's status socket, stdin, stdout, stderr); the worker itself writes
``pid N`` on the status socket once it leads its own process group (so the agent can signal the
group from then on), and the server writes ``exit CODE`` (negative: killed by signal -CODE) when
it reaped it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

__all__ = ["ForkServer", "read_status"]

SERVER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkserver.py")


class ForkServer:
    """The agent's handle on the server process. ``preload``: warm start (fork server with torch
    imported); otherwise every worker is a fresh ``exec``."""

    def __init__(self, preload: bool) -> None:
        self.preload = preload
        self._forked = False  # whether a worker was ever asked for
        self._ctl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mode = "--preload" if preload else "--plain"
        self.proc = subprocess.Popen(
            [sys.executable, SERVER_SCRIPT, mode, str(theirs.fileno()), str(os.getpid())],
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
              stdin: int | None = None) -> tuple[int, socket.socket]:
        """Starts a worker; returns its pid (== its process group) and its status socket.
        ``stdin``: the worker's standard input (None: /dev/null)."""
        self._forked = True
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        null = os.open(os.devnull, os.O_RDONLY) if stdin is None else -1
        try:
            msg = json.dumps({"argv": argv, "env": env, "cwd": cwd, "kind": kind}).encode()
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
