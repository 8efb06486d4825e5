"""The fork server's stand-in: while the fork server imports in its idle time (preloading), a
copy of it forked just before that began answers the agent and forks the workers, so that a
restart never waits for a preload.

A fork is only ever taken between imports: the stand-in is forked before the fork server starts
importing, and the fork server forks again only once the import returned (it serves nothing in
between). A worker forked by the stand-in starts without what the import brings (it imports it
itself, as without preloading); never with a module imported in part.

The stand-in's workers are the fork server's children all the same (it reaps them, reports their
exit and kills them with the agent): the stand-in forks a short-lived intermediate process that
forks the worker, sends the fork server the worker's pid and status socket (``notes``) and exits;
the kernel then hands the orphaned worker to its nearest child subreaper, the fork server, and
the worker goes on once its parent is the fork server. The note always comes before the worker
can be the fork server's child, so the fork server knows every child it reaps.

The fork server ends the stand-in by closing its end of a pipe; the stand-in serves the request
it is reading to its end and exits: no request is lost or served twice (each is one datagram).

Standard library only: the fork server (run as a script) loads this file by its path.
"""

from __future__ import annotations

import array
import ctypes
import gc
import json
import os
import select
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

__all__ = ["StandIn", "take_notes"]

PR_SET_PDEATHSIG = 1
REPARENT_TIMEOUT_S = 10.0  # a worker whose parent is not the fork server by then exits (137)
STOP_POLL_S = 0.05
# What the agent's preload request gets from the stand-in: nothing finished since the last one
# (the fork server reports it to the next request).
NOTHING_YET = {"preloaded": [], "refused": {}, "submodules": 0, "unavailable": 0,
               "env_reads": {}, "seconds": 0.0, "tainted": None}


def take_notes(notes: socket.socket, workers: dict[int, socket.socket]) -> int:
    """In the fork server: registers the workers its stand-ins forked (pid -> status socket);
    returns how many."""
    size = socket.CMSG_LEN(array.array("i").itemsize)
    for n in range(100_000):
        try:  # (socket.recv_fds drops its flags argument)
            msg, ancdata, _, _ = notes.recvmsg(64, size, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return n
        fds = array.array("i")
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        if not msg or not fds:
            return n
        workers[int(msg)] = socket.socket(fileno=fds[0])
    return 100_000


class StandIn:
    """Made by the fork server before it imports; ``fork()`` forks the stand-in process."""

    def __init__(self, notes: tuple[socket.socket, socket.socket], max_msg: int) -> None:
        self.server = os.getpid()
        (self.notes_r, self.notes_w), self.max_msg = notes, max_msg
        self.stop_r, self.stop_w = os.pipe()
        self.pid = 0
        self.exited = False

    def fork(self, ctl: socket.socket, prepare: Callable[[dict[str, Any], list[int]], None],
             ) -> dict[str, Any] | None:
        """In the fork server: starts the stand-in (returns None). In a worker that the stand-in
        forked: returns the job, made ready by ``prepare(job, fds)`` (which closes the fork
        server's descriptors in it)."""
        self.pid = os.fork()
        if self.pid == 0:
            return self._serve(ctl, prepare)
        os.close(self.stop_r)
        return None

    def alive(self) -> bool:
        """In the fork server: False once the stand-in exited (the agent closed the socket)."""
        if not self.exited:
            try:
                self.exited = os.waitpid(self.pid, os.WNOHANG)[0] == self.pid
            except ChildProcessError:
                self.exited = True
        return not self.exited

    def stop(self, workers: dict[int, socket.socket]) -> None:
        """In the fork server, once its import ended: the stand-in exits after the request it
        is serving; the workers it forked are registered."""
        os.close(self.stop_w)
        while self.alive():
            select.select([self.notes_r], [], [], STOP_POLL_S)
            take_notes(self.notes_r, workers)
        take_notes(self.notes_r, workers)

    # -- in the stand-in -----------------------------------------------------------------------

    def _serve(self, ctl: socket.socket,
               prepare: Callable[[dict[str, Any], list[int]], None]) -> dict[str, Any] | None:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != self.server:
            os._exit(0)
        os.close(self.stop_w)
        for _ in iter(int, 1):
            ready = select.select([ctl.fileno(), self.stop_r], [], [])[0]
            if ctl.fileno() not in ready:
                os._exit(0)  # the fork server serves again
            try:
                msg, fds, _, _ = socket.recv_fds(ctl, self.max_msg, 4)
            except OSError:
                msg, fds = b"", []
            if not msg:
                os._exit(0)  # the agent closed the socket or died: the fork server sees it
            request = json.loads(msg)
            op = request.get("op")
            if op in ("ready", "preload", "teach", "names"):  # "teach": the server's, asked again
                answers = {"ready": b"ready", "teach": b"busy", "names": b"[]"}
                answer = answers.get(op) or json.dumps(NOTHING_YET).encode()
                try:
                    if fds:
                        os.write(fds[0], answer)
                except OSError:
                    pass
                for fd in fds:
                    os.close(fd)
                continue
            job = self._fork(request, fds)
            if job is not None:
                prepare(job, fds)
                return job
        return None

    def _fork(self, job: dict[str, Any], fds: list[int]) -> dict[str, Any] | None:
        gc.freeze()  # as the fork server does (forkserver._Server._fork)
        middle = os.fork()
        if middle == 0:
            worker = os.fork()
            if worker == 0:
                deadline = time.monotonic() + REPARENT_TIMEOUT_S
                while os.getppid() != self.server:  # the intermediate process is exiting
                    if time.monotonic() > deadline:
                        os._exit(137)
                    time.sleep(0.0005)
                os.close(self.stop_r)
                job["parent"] = self.server
                return job
            try:
                socket.send_fds(self.notes_w, [str(worker).encode()], [fds[0]])
            except OSError:  # the fork server is gone
                os.kill(worker, signal.SIGKILL)
            os._exit(0)
        os.waitpid(middle, 0)
        for fd in fds:
            os.close(fd)
        return None
