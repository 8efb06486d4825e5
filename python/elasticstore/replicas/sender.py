"""The sending side of replicas: a thread of the agent that copies a complete step of its node's
sharded snapshots to the ring successor's agent (``receiver.py``), off the workers' critical path
(a worker that dies mid-transfer loses nothing: the agent carries on).

Every ``POLL_S`` it lists the area: the steps for which every local rank has a complete file, all
of sharded state (``peek``; replicated and per-rank state is not replicated: any rank's copy
serves, or only the same rank may have it back). Which step it sends: under the round's schedule
(``planned``, ``schedule.py``), the step the agents agreed on: per local rank the oldest step
``>= floor`` written in this round, the same on every rank, once per plan; its outcome is
``result`` (the plan's number and the step placed, or -1: missed, the ranks' oldest steps differ
or a file was taken for a newer step while sent: the workers saw the hold too late). Without a
plan (``planned=False``): the newest step, once per successor (again when its files were
rewritten: their inodes). ``newest``: the newest complete step written in this round (the leader's
floor is read from it).

A worker reuses the memory of a snapshot it no longer keeps (``writer.py``; under a plan it keeps
the held steps, ``hold.py``): the files are read while they keep their names, and after the
receiver said it has every byte (``sendfile`` reads the pages when they are sent, not when it
returns) each is checked to still be the file that was read (same inode under the same name);
else the transfer is withdrawn. Failures are said once per successor and retried after
``RETRY_S``.

Each transfer says the round (``attempt``) its files were written in: this round's when every
file was renamed into place (its ctime) after the round began, else -1; and the step the receiver
keeps besides its two newest (``keep``: the committed one). And each pass reports the oldest step
this node's workers wrote in this round (``on_own``): the receiver drops the replicas from before
this round from that step on (``receiver.py``: a job that resumed from an older step takes the
later steps again; their earlier copies are of another history).
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
Plan = tuple[int, int]  # a plan's id: (round, its number in the round)


class Sender:
    """``area``: this node's snapshot area; ``nproc``: its local ranks; ``sender_id``: this
    agent's (the receiver keeps files per sender); ``token``: the run's ("" none); ``host``: the
    address connections leave from (the one the receiver knows this node by; "": any);
    ``planned``: send only the steps of ``set_plan`` (module doc)."""

    def __init__(self, area: str, nproc: int, sender_id: str, token: str, host: str = "",
                 log: Callable[[str], None] = lambda _: None,
                 on_own: Callable[[int, int], None] = lambda _a, _s: None,
                 planned: bool = False) -> None:
        self.area, self.nproc, self.id, self._token, self._log = area, nproc, sender_id, token, log
        self.host, self._on_own, self._planned = host, on_own, planned
        self._round: tuple[int, int] | None = None  # (attempt, its start in time.time_ns())
        self._target: Target | None = None
        self._plan: tuple[Plan, int, int] | None = None  # (its id, floor, keep)
        self.result: tuple[Plan, int] | None = None  # (plan id, step placed; -1: missed)
        self.newest: int | None = None  # the newest complete step written in this round
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

    def set_plan(self, plan: Plan, floor: int, keep: int | None) -> None:
        """The plan ``plan`` (round, number): send the step held from ``floor`` on, once; the
        receiver is to keep ``keep`` (the committed step) besides its two newest."""
        self._plan = (plan, floor, -1 if keep is None else keep)
        self._retry_at = 0.0

    def new_round(self, attempt: int, started_ns: int) -> None:
        """The round this node's workers now run in, begun at ``started_ns`` (``time.time_ns``:
        the clock of the files' ctime); no plan until the round's schedule sets one."""
        self._plan = self.result = self.newest = None
        self._round = (attempt, started_ns)

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
        """One look at the area: the step to send sent when it was not yet (module doc)."""
        target, plan, rnd, files = self._target, self._plan, self._round, list_complete(self.area)
        fresh = self._fresh(files, rnd)
        if fresh and rnd is not None:
            self._on_own(rnd[0], fresh[0][0])
        newest = self._newest(fresh)
        self.newest = None if newest is None else newest[0]
        if target is None or time.monotonic() < self._retry_at:
            return
        if self._planned:
            if plan is None or (self.result is not None and self.result[0] == plan[0]):
                return  # no plan yet, or this one is done
            chosen = self._held(fresh, plan[0], plan[1])
        else:
            chosen = self._newest(files)
        if chosen is None:
            return
        step, paths = chosen
        try:
            key = (target, step, tuple(os.stat(p).st_ino for p in paths))
        except OSError:
            return  # a file renamed meanwhile (reused for a newer step)
        if key == self._sent:
            if plan is not None and self._planned:
                self.result = (plan[0], step)  # placed already (for an earlier plan)
            return
        try:
            started = time.monotonic()
            placed = self._send(target, step, paths, -1 if plan is None else plan[2])
            if placed:
                self._sent, self._said = key, None
                self.sent += 1
                self.last_s = time.monotonic() - started
            if plan is not None and self._planned:
                self.result = (plan[0], step if placed else -1)
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

    def _fresh(self, files: list[tuple[int, int, str]],
               rnd: tuple[int, int] | None) -> list[tuple[int, int, str]]:
        """The files written in round ``rnd`` (renamed into place after it began), oldest first."""
        if rnd is None:
            return []
        found = []
        for step, local, path in files:
            try:
                if os.stat(path).st_ctime_ns >= rnd[1]:
                    found.append((step, local, path))
            except OSError:
                continue
        return found

    def _held(self, fresh: list[tuple[int, int, str]], number: Plan,
              floor: int) -> tuple[int, list[str]] | None:
        """The step of plan ``number``: each local rank's oldest step ``>= floor``, when they
        agree (they do not: ``result`` says missed); None while a rank has none yet."""
        oldest: dict[int, tuple[int, str]] = {}
        for step, local, path in fresh:
            if step >= floor and local < self.nproc and local not in oldest:
                oldest[local] = (step, path)
        if len(oldest) < self.nproc:
            return None
        steps = {step for step, _ in oldest.values()}
        if len(steps) > 1:
            self.result = (number, -1)
            return None
        paths = [oldest[i][1] for i in range(self.nproc)]
        try:
            if not all(self._sharded(p) for p in paths):
                return None
        except (OSError, ValueError):
            self.result = (number, -1)  # taken for a newer step: the hold came too late
            return None
        return steps.pop(), paths

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

    def _send(self, target: Target, step: int, paths: list[str], keep: int) -> bool:
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
                                  "attempt": self._written_in(stats), "keep": keep,
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
