"""Forked client processes for the benchmarks: start together, report back, never outlive us.

A child is forked from the measuring process (after torch and elasticstore are imported, so its
pages are shared copy-on-write), carries PR_SET_PDEATHSIG, and sends its result back pickled
through a pipe; the parent kills and reaps every child on any error or timeout.

A client that cannot live in a forked copy of the measuring process (etcd's: gRPC, whose state
does not survive a fork without its fork support, and whose fork handlers can block ``fork()``
for good: the measuring process runs with them off, see etcd_peer.py) gets its children from a
fresh interpreter instead (``fresh=``: ``fresh_child.py``, started by fork + exec, forks them
after importing the client once): the same protocol, the same pipes.
"""

from __future__ import annotations

import mmap
import os
import pickle
import selectors
import signal
import struct
import sys
import time
import traceback
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


def send_error(w: int) -> None:
    """In a child: the exception being handled, as the "E" frame its parent's reader raises."""
    msg = traceback.format_exc().encode()
    os.write(w, b"E" + struct.pack("<I", len(msg)) + msg)


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


def _exec_fresh(prepare: Callable[[], None], entries: list, keep: list) -> NoReturn:
    """In a forked child that must not run Python code of the parent's: execs fresh_child.py,
    which runs ``prepare()`` and then each entry (fn, w, args) in a child of its own. ``keep``:
    the descriptors that it inherits (the entries' pipes and what their args name)."""
    w = entries[0][1]
    try:
        procs.set_pdeathsig()  # kept across exec
        payload = os.memfd_create("bench-fresh-child", 0)  # no MFD_CLOEXEC: inherited
        os.write(payload, pickle.dumps((prepare, entries)))
        os.lseek(payload, 0, os.SEEK_SET)
        for fd in keep:
            os.set_inheritable(fd, True)
        writers = ",".join(str(e[1]) for e in entries)
        os.execv(sys.executable, [sys.executable, FRESH_SCRIPT, str(payload), writers])
    except BaseException:
        try:
            send_error(w)
        finally:
            os._exit(1)


def fork_child(fn, *args, fresh: Optional[Callable[[], None]] = None) -> tuple[int, int]:
    """Forks a child running fn(write_fd, *args); returns (pid, read_fd). The child dies with us.
    ``fresh``: the child runs in a fresh interpreter that calls ``fresh()`` first (fn and args
    must then be picklable: module-level functions and plain values)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        if fresh is not None:
            _exec_fresh(fresh, [(fn, w, args)], [w])
        child_main(w, fn, args)
    os.close(w)
    procs._CHILDREN.add(pid)
    return pid, r


def reap(pid: int, kill: bool = False) -> None:
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
        else:
            pipes = [os.pipe() for _ in args_list]
            entries = [(_ready_child, w, (fn, go_r, -1, start_fd, *args))
                       for (_, w), args in zip(pipes, args_list)]
            pid = os.fork()
            if pid == 0:  # one fresh interpreter forks every child
                for r, _ in pipes:
                    os.close(r)
                _exec_fresh(fresh, entries, [w for _, w in pipes] + [go_r, start_fd])
            procs._CHILDREN.add(pid)
            for r, w in pipes:
                os.close(w)
                kids.append((pid, r))
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
