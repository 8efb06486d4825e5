"""The sending side of replicas: a thread of the agent that copies its node's newest complete
step of sharded snapshots to the ring successor's agent (``receiver.py``), off the workers'
critical path (a worker that dies mid-transfer loses nothing: the agent carries on).

Every ``POLL_S`` it lists the area: the newest step for which every local rank has a complete
file, all of sharded state (``peek``; replicated and per-rank state is not replicated: any rank's
copy serves, or only the same rank may have it back). A step is sent once per successor (again
when its files were rewritten: their inodes). A worker reuses the memory of its snapshot two
steps older: the files are read while they keep their names, and once the receiver said it read
every byte (``sendfile`` hands the file's pages to the socket: they are read when they are sent,
not when it returns) each is checked to still be the file that was read (same inode under the
same name); else the transfer is withdrawn and the newer step sent on the next pass. Failures are said once per successor and
retried after ``RETRY_S``; so is a replica that lags two steps or more behind the workers (a
node loss would then find no step whose every shard survived: the disk checkpoint is taken).

Each transfer says the round (``attempt``) its files were written in: this round's when every
file was renamed into place (its ctime) after the round began, else -1. And each pass reports the
oldest step this node's workers wrote in this round (``on_own``): the receiver drops the replicas
from before this round from that step on (``receiver.py``: a job that resumed from an older step
takes the later steps again; their earlier copies are of another history).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

from ..train.snapshots.peek import list_complete, peek
from .wire import (IDLE_S, NONCE_BYTES, PREAMBLE, ReplicaError, deadline_for, mac, recv_exact,
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
                 log: Callable[[str], None] = lambda _: None,
                 on_own: Callable[[int, int], None] = lambda _a, _s: None) -> None:
        self.area, self.nproc, self.id, self._token, self._log = area, nproc, sender_id, token, log
        self.host, self._on_own = host, on_own
        self._round: tuple[int, int] | None = None  # (attempt, its start in time.time_ns())
        self._lag_said = False
        self._target: Target | None = None
        self._sent: tuple[Target, int, tuple[int, ...]] | None = None
        self._said: Target | None = None  # a failure was said for this successor
        self._retry_at = 0.0
        self._ids: dict[tuple[str, int, int], bool] = {}  # (path, inode, mtime) -> sharded
        self.sent = 0  # transfers completed
        self.last_bytes = 0
        self.last_s = 0.0
        self._stop = threading.Event()
        self._sock: socket.socket | None = None  # the transfer in progress
        self._thread = threading.Thread(target=self._run, name="replica-sender", daemon=True)
        self._thread.start()

    def set_target(self, target: Target | None) -> None:
        """The successor of this round (None: no ring, one node)."""
        self._target = target
        self._retry_at = 0.0

    def new_round(self, attempt: int, started_ns: int) -> None:
        """The round this node's workers now run in, begun at ``started_ns`` (``time.time_ns``:
        the clock of the files' ctime)."""
        self._round = (attempt, started_ns)
        self._lag_said = False

    def close(self) -> None:
        """Stops at once, a transfer in progress too (the receiver drops it)."""
        self._stop.set()
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(5)

    def _run(self) -> None:
        broken = False
        while not self._stop.wait(POLL_S):
            try:
                self._pass()
            except Exception as err:  # the thread goes on: said once
                if not broken and not self._stop.is_set():
                    self._log(f"[elasticstore-run] replicas: {type(err).__name__}: {err}")
                broken = True

    def _pass(self) -> None:
        """One look at the area: the newest step sent when it was not yet."""
        target, files = self._target, list_complete(self.area)
        self._report_own(files)
        if target is None or time.monotonic() < self._retry_at:
            return
        newest = self._newest(files)
        if newest is None:
            return
        step, paths = newest
        try:
            key = (target, step, tuple(os.stat(p).st_ino for p in paths))
        except OSError:
            return  # a file renamed meanwhile (reused for a newer step)
        if key == self._sent:
            return
        try:
            started = time.monotonic()
            if self._send(target, step, paths):
                self._sent, self._said = key, None
                self.sent += 1
                self.last_s = time.monotonic() - started
                self._check_lag(step)
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

    def _report_own(self, files: list[tuple[int, int, str]]) -> None:
        """The oldest step of this node's files written in this round, to ``on_own``."""
        if self._round is None:
            return
        attempt, started = self._round
        steps = []
        for step, _, path in files:
            try:
                if os.stat(path).st_ctime_ns >= started:
                    steps.append(step)
            except OSError:
                continue
        if steps:
            self._on_own(attempt, min(steps))

    def _check_lag(self, sent: int) -> None:
        newest = self._newest(list_complete(self.area))
        if newest is not None and newest[0] >= sent + 2 and not self._lag_said:
            self._lag_said = True
            self._log(f"[elasticstore-run] the replica lags: step {sent} took {self.last_s:.2f}s "
                      f"to copy and the workers are at step {newest[0]}; until it keeps up, a "
                      "node lost resumes from the disk checkpoint (snapshot less often, or a "
                      "faster network between the nodes)")

    def _newest(self, listed: list[tuple[int, int, str]]) -> tuple[int, list[str]] | None:
        """The newest step every local rank holds a complete file of (sharded), with the files."""
        by_step: dict[int, dict[int, str]] = {}
        for step, local, path in listed:
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
            try:
                heads = [peek(fd=fd) for fd in fds]
            except ValueError:
                return False  # being rewritten (its worker took it for a newer step): next pass
            if any(h.step != step for h in heads):
                return False
            sizes = [h.used for h in heads]  # not the buffer's spare room
            deadline = deadline_for(sum(sizes))
            with self._connect(target) as sock:
                self._sock = sock
                hello = recv_exact(sock, len(PREAMBLE) + NONCE_BYTES, deadline)
                if hello[:len(PREAMBLE)] != PREAMBLE:
                    raise ReplicaError(f"{target[0]}:{target[1]} is not a replica endpoint")
                nonce = hello[len(PREAMBLE):]
                send_frame(sock, {"sender": self.id, "step": step, "sizes": sizes,
                                  "attempt": self._written_in(stats),
                                  "mac": mac(self._token, nonce) if self._token else ""}, deadline)
                reply = recv_frame(sock, deadline)
                if reply.get("ok") is not True:
                    raise ReplicaError(f"refused: {reply.get('error')!s:.200}")
                for fd, size in zip(fds, sizes):
                    with os.fdopen(os.dup(fd), "rb") as f:
                        sock.settimeout(min(IDLE_S, max(0.1, deadline - time.monotonic())))
                        if sock.sendfile(f, 0, size) != size:
                            raise ReplicaError("a snapshot file shrank while it was sent")
                if recv_frame(sock, deadline).get("received") is not True:  # every byte read
                    raise ReplicaError("the receiver did not confirm the bytes")
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
            self._sock = None
            for fd in fds:
                os.close(fd)

    def _written_in(self, stats: list[os.stat_result]) -> int:
        rnd = self._round
        if rnd is None or any(st.st_ctime_ns < rnd[1] for st in stats):
            return -1
        return rnd[0]


def _same(path: str, st: os.stat_result) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino, now.st_size) == (st.st_dev, st.st_ino, st.st_size)
