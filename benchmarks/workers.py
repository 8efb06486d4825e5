"""Forked client processes for the benchmarks: start together, report back, never outlive us.

A child is forked from the measuring process (after torch and elasticstore are imported, so its
pages are shared copy-on-write), carries PR_SET_PDEATHSIG, and sends its result back pickled
through a pipe; the parent kills and reaps every child on any error or timeout.

A client that cannot live in a forked copy of the measuring process (etcd's: gRPC, whose state
does not survive a fork without its fork support, and whose fork handlers can block ``fork()``
for good: the measuring process runs with them off, see etcd_peer.py) gets its children from a
fresh interpreter instead (``fresh=``: ``fresh_child.py``, started by fork + exec once per run
and client, imports the client once and forks children on request, the pipes handed over with
SCM_RIGHTS): the same protocol, the same pipes.
"""

from __future__ import annotations

import mmap
import os
import pickle
import selectors
import signal
import socket
import struct
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, NoReturn, Optional

import procs

pc = time.perf_counter_ns




def _read_exact(fd: int, n: int, deadline: float) -> bytes:
    buf = b""
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    try:
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"child did not answer in time ({len(buf)}/{n} bytes)")
            if sel.select(left):
                chunk = os.read(fd, n - len(buf))
                if not chunk:
                    raise EOFError("child closed its pipe")
                buf += chunk
    finally:
        sel.close()
    return buf


FRESH_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fresh_child.py")
FRESH_TIMEOUT = 120.0  # s for the fresh interpreter to answer (its start imports torch)
_MAX_REPLY = 1 << 20


def error_frame() -> bytes:
    """The exception being handled, as the "E" frame a reader raises ``ChildFailed`` from."""
    msg = traceback.format_exc().encode()
    return b"E" + struct.pack("<I", len(msg)) + msg


def send_error(w: int) -> None:
    """In a child: the exception being handled, as the "E" frame its parent's reader raises."""
    os.write(w, error_frame())


def child_main(w: int, fn, args: tuple) -> NoReturn:
    """In a child: runs fn(w, *args), sends a failure's traceback on w, never returns."""
    code = 0
    try:
        procs.set_pdeathsig()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        fn(w, *args)
    except BaseException:
        code = 1
        try:
            send_error(w)
        except OSError:
            pass
    finally:
        os._exit(code)


@dataclass(frozen=True)
class Fd:
    """In a fresh child's args: the ``index``-th descriptor handed over with the request."""

    index: int


class _Forker:
    """The measuring process's end of one fresh interpreter (``fresh_child.py`` says how it
    works): started at the first use of its ``prepare``, kept for the run, killed at exit."""

    def __init__(self, prepare: Callable[[], None]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:  # must not run Python code of the parent's: exec at once
            try:
                ours.close()
                procs.set_pdeathsig()  # kept across exec
                os.set_inheritable(theirs.fileno(), True)
                os.execv(sys.executable, [sys.executable, FRESH_SCRIPT, str(theirs.fileno())])
            finally:
                os._exit(1)
        theirs.close()
        procs._CHILDREN.add(pid)
        self.pid, self.conn = pid, ours
        ours.settimeout(FRESH_TIMEOUT)
        try:
            self._ask(pickle.dumps(prepare), [])
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kills it (its children die with it: PR_SET_PDEATHSIG) and reaps it."""
        self.conn.close()
        reap(self.pid, kill=True)

    def _ask(self, msg: bytes, fds: list[int]) -> bytes:
        socket.send_fds(self.conn, [msg], fds)
        reply = self.conn.recv(_MAX_REPLY)
        if not reply:
            raise ChildFailed("the fresh interpreter that forks the children exited")
        if reply[:1] == b"E":
            raise ChildFailed(reply[5:].decode(errors="replace"))
        return reply

    def fork(self, entries: list, fds: list[int]) -> list[int]:
        """Forks a child per entry ``(fn, w, args)``: ``w`` and each ``Fd`` in ``args`` index
        ``fds`` (handed over; the caller still closes its own); returns their pids."""
        return pickle.loads(self._ask(pickle.dumps(("fork", entries)), fds))

    def reap(self, pid: int) -> None:
        self._ask(pickle.dumps(("reap", [pid])), [])


_FORKERS: dict[Callable[[], None], _Forker] = {}
_FRESH_KIDS: dict[int, _Forker] = {}  # a fresh interpreter's children: reaped by it


def _fresh_fork(prepare: Callable[[], None], entries: list, fds: list[int]) -> list[int]:
    """Forks ``entries`` from the fresh interpreter of ``prepare`` (started on first use; one
    that failed is replaced at the next call)."""
    forker = _FORKERS.get(prepare)
    try:
        if forker is None:
            forker = _FORKERS[prepare] = _Forker(prepare)
        pids = forker.fork(entries, fds)
    except BaseException:
        gone = _FORKERS.pop(prepare, None)
        if gone is not None:
            gone.close()
        raise
    for pid in pids:
        _FRESH_KIDS[pid] = forker
    return pids


def fork_child(fn, *args, fresh: Optional[Callable[[], None]] = None) -> tuple[int, int]:
    """Forks a child running fn(write_fd, *args); returns (pid, read_fd). The child dies with us.
    ``fresh``: the child is forked by a fresh interpreter that called ``fresh()`` first (fn and
    args must then be picklable: module-level functions and plain values)."""
    r, w = os.pipe()
    if fresh is not None:
        try:
            (pid,) = _fresh_fork(fresh, [(fn, 0, args)], [w])
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        return pid, r
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        child_main(w, fn, args)
    os.close(w)
    procs._CHILDREN.add(pid)
    return pid, r


def reap(pid: int, kill: bool = False) -> None:
    forker = _FRESH_KIDS.pop(pid, None)
    if forker is not None:  # not our child: its pid stays its forker's until reaped there
        try:
            if kill:
                os.kill(pid, signal.SIGKILL)
            forker.reap(pid)
        except (OSError, ChildFailed):
            pass  # the fresh interpreter is gone: its children died with it
        return
    try:
        if kill:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    procs._CHILDREN.discard(pid)


class ChildFailed(RuntimeError):
    pass


def _send(w: int, tag: bytes, payload: bytes = b"") -> None:
    data = tag + struct.pack("<I", len(payload)) + payload
    while data:
        data = data[os.write(w, data):]


def _recv(r: int, deadline: float) -> tuple[bytes, bytes]:
    head = _read_exact(r, 5, deadline)
    (n,) = struct.unpack("<I", head[1:])
    payload = _read_exact(r, n, deadline) if n else b""
    if head[:1] == b"E":
        raise ChildFailed(payload.decode(errors="replace"))
    return head[:1], payload


def _ready_child(w: int, fn, go_r: int, go_w: int, start_fd: int, *args) -> None:
    """A run_workers child: fn(ready, *args); its result goes back pickled on w."""
    if go_w >= 0:  # a forked copy holds the parent's end of the go pipe: "parent went away"
        os.close(go_w)  # must see EOF when the parent dies
    start = mmap.mmap(start_fd, 8)

    def ready() -> int:
        _send(w, b"R")
        if os.read(go_r, 1) != b"G":
            raise RuntimeError("parent went away")
        return struct.unpack("<q", start[:8])[0]

    _send(w, b"D", pickle.dumps(fn(ready, *args)))


def run_workers(fn, args_list: list, timeout: float, on_ready=None,
                fresh: Optional[Callable[[], None]] = None) -> list:
    """Forks one process per args; each runs fn(ready, *args) and returns a picklable result.
    ``ready()`` tells the parent this child is set up and returns the common start time
    (perf_counter_ns) once every child is ready; ``on_ready()`` runs in the parent then.
    ``fresh``: the children are forked by a fresh interpreter that calls ``fresh()`` first
    (see the module's doc; fn and args must be picklable)."""
    go_r, go_w = os.pipe()
    start_fd = os.memfd_create("bench-start", os.MFD_CLOEXEC)
    os.ftruncate(start_fd, 8)
    shared = mmap.mmap(start_fd, 8)

    kids: list[tuple[int, int]] = []
    deadline = time.monotonic() + timeout
    try:
        if fresh is None:
            for args in args_list:
                kids.append(fork_child(_ready_child, fn, go_r, go_w, start_fd, *args))
        else:  # the fresh interpreter forks every child (go_r and start_fd handed over too)
            pipes = [os.pipe() for _ in args_list]
            n = len(pipes)
            entries = [(_ready_child, i, (fn, Fd(n), -1, Fd(n + 1), *args))
                       for i, args in enumerate(args_list)]
            try:
                pids = _fresh_fork(fresh, entries, [w for _, w in pipes] + [go_r, start_fd])
            except BaseException:
                for r, _ in pipes:
                    os.close(r)
                raise
            finally:
                for _, w in pipes:
                    os.close(w)
            kids.extend((pid, r) for pid, (r, _) in zip(pids, pipes))
        os.close(go_r)
        for _, r in kids:
            tag, _ = _recv(r, deadline)
            if tag != b"R":
                raise ChildFailed(f"child finished before ready: {tag!r}")
        if on_ready is not None:
            on_ready()
        shared[:8] = struct.pack("<q", pc() + 50_000_000)  # start together, 50 ms from now
        os.write(go_w, b"G" * len(kids))
        results = [pickle.loads(_recv(r, deadline)[1]) for _, r in kids]
    finally:
        os.close(go_w)
        for pid, r in kids:
            os.close(r)
            reap(pid, kill=True)
        shared.close()
        os.close(start_fd)
    return results


def sleep_until(t_ns: int) -> None:
    while True:
        left = t_ns - pc()
        if left <= 0:
            return
        time.sleep(min(left / 1e9, 0.01) if left > 2_000_000 else 0)
