"""The sending side of replicas: a thread of the agent that copies its node's newest complete
step of sharded snapshots to the ring successor's agent (``receiver.py``), off the workers'
critical path (a worker that dies mid-transfer loses nothing: the agent carries on).

Every ``POLL_S`` it lists the area: the newest step for which every local rank has a complete
file, all of sharded state (``peek``; replicated and per-rank state is not replicated: any rank's
copy serves, or only the same rank may have it back). A step is sent once per successor (again
when its files were rewritten: their inodes). A worker reuses the memory of its snapshot two
steps older: the files are read while they keep their names, and after the copy each is checked
to still be the file that was read (same inode under the same name); else the transfer is
withdrawn and the newer step sent on the next pass. Failures are said once per successor and
retried after ``RETRY_S``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

from ..train.snapshots.peek import list_complete, peek
from .wire import (NONCE_BYTES, PREAMBLE, ReplicaError, deadline_for, mac, recv_exact,
                   recv_frame, send_frame)

__all__ = ["Sender"]

POLL_S = 0.05
RETRY_S = 1.0
CONNECT_S = 5.0

Target = tuple[str, int]


class Sender:
    """``area``: this node's snapshot area; ``nproc``: its local ranks; ``sender_id``: this
    agent's (the receiver keeps files per sender); ``token``: the run's ("" none); ``host``: the
    address connections leave from (the one the receiver knows this node by; "": any)."""

    def __init__(self, area: str, nproc: int, sender_id: str, token: str, host: str = "",
                 log: Callable[[str], None] = lambda _: None) -> None:
        self.area, self.nproc, self.id, self._token, self._log = area, nproc, sender_id, token, log
        self.host = host
        self._target: Target | None = None
        self._sent: tuple[Target, int, tuple[int, ...]] | None = None
        self._said: Target | None = None  # a failure was said for this successor
        self._retry_at = 0.0
        self._ids: dict[tuple[str, int, int], bool] = {}  # (path, inode, mtime) -> sharded
        self.sent = 0  # transfers completed
        self.last_bytes = 0
        self.last_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-sender", daemon=True)
        self._thread.start()

    def set_target(self, target: Target | None) -> None:
        """The successor of this round (None: no ring, one node)."""
        self._target = target
        self._retry_at = 0.0

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            target = self._target
            if target is None or time.monotonic() < self._retry_at:
                continue
            newest = self._newest()
            if newest is None:
                continue
            step, paths = newest
            try:
                key = (target, step, tuple(os.stat(p).st_ino for p in paths))
            except OSError:
                continue  # a file renamed meanwhile (reused for a newer step)
            if key == self._sent:
                continue
            try:
                started = time.monotonic()
                if self._send(target, step, paths):
                    self._sent, self._said = key, None
                    self.sent += 1
                    self.last_s = time.monotonic() - started
            except (OSError, ReplicaError, ValueError) as err:
                if self._said != target:
                    self._said = target
                    self._log(f"[elasticstore-run] replica of step {step} to {target[0]}:"
                              f"{target[1]} failed ({type(err).__name__}: {err}); retrying")
                self._retry_at = time.monotonic() + RETRY_S

    def _sharded(self, path: str) -> bool:
        st = os.stat(path)
        key = (path, st.st_ino, st.st_mtime_ns)
        if key not in self._ids:
            if len(self._ids) > 64 * self.nproc:
                self._ids.clear()
            self._ids[key] = peek(path).sharded
        return self._ids[key]

    def _newest(self) -> tuple[int, list[str]] | None:
        """The newest step every local rank holds a complete file of (sharded), with the files."""
        by_step: dict[int, dict[int, str]] = {}
        for step, local, path in list_complete(self.area):
            by_step.setdefault(step, {})[local] = path
        for step in sorted(by_step, reverse=True):
            files = by_step[step]
            if set(files) != set(range(self.nproc)):
                continue
            paths = [files[i] for i in range(self.nproc)]
            try:
                if not all(self._sharded(p) for p in paths):
                    return None
            except (OSError, ValueError):
                continue  # a file renamed meanwhile (reused for a newer step)
            return step, paths
        return None

    def _connect(self, target: Target) -> socket.socket:
        if self.host:
            try:
                return socket.create_connection(target, CONNECT_S, (self.host, 0))
            except OSError:
                pass  # not an address of this machine (a name for another interface)
        return socket.create_connection(target, CONNECT_S)

    def _send(self, target: Target, step: int, paths: list[str]) -> bool:
        """One transfer; whether the files were placed (False: one changed while read)."""
        fds = [os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in paths]
        try:
            stats = [os.fstat(fd) for fd in fds]
            for fd in fds:
                if peek(fd=fd).step != step:
                    return False
            sizes = [st.st_size for st in stats]
            deadline = deadline_for(sum(sizes))
            with self._connect(target) as sock:
                hello = recv_exact(sock, len(PREAMBLE) + NONCE_BYTES, deadline)
                if hello[:len(PREAMBLE)] != PREAMBLE:
                    raise ReplicaError(f"{target[0]}:{target[1]} is not a replica endpoint")
                nonce = hello[len(PREAMBLE):]
                send_frame(sock, {"sender": self.id, "step": step, "sizes": sizes,
                                  "mac": mac(self._token, nonce) if self._token else ""}, deadline)
                reply = recv_frame(sock, deadline)
                if reply.get("ok") is not True:
                    raise ReplicaError(f"refused: {reply.get('error')!s:.200}")
                for fd, size in zip(fds, sizes):
                    with os.fdopen(os.dup(fd), "rb") as f:
                        sock.settimeout(max(0.1, deadline - time.monotonic()))
                        if sock.sendfile(f, 0, size) != size:
                            raise ReplicaError("a snapshot file shrank while it was sent")
                same = all(_same(p, st) for p, st in zip(paths, stats))
                send_frame(sock, {"commit": same}, deadline)
                if not same:
                    return False
                reply = recv_frame(sock, deadline)
                if reply.get("ok") is not True:
                    raise ReplicaError(f"not placed: {reply.get('error')!s:.200}")
                self.last_bytes = sum(sizes)
                return True
        finally:
            for fd in fds:
                os.close(fd)


def _same(path: str, st: os.stat_result) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino, now.st_size) == (st.st_dev, st.st_ino, st.st_size)
