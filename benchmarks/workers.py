"""Forked client processes for the benchmarks: start together, report back, never outlive us.

A child is forked from the measuring process (after torch and elasticstore are imported, so its
pages are shared copy-on-write), carries PR_SET_PDEATHSIG, and sends its result back pickled
through a pipe; the parent kills and reaps every child on any error or timeout.
"""

from __future__ import annotations

import mmap
import os
import pickle
import selectors
import signal
import struct
import time
import traceback

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


def fork_child(fn, *args) -> tuple[int, int]:
    """Forks a child running fn(write_fd, *args); returns (pid, read_fd). The child dies with us."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            procs.set_pdeathsig()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            fn(w, *args)
        except BaseException:
            code = 1
            try:
                msg = traceback.format_exc().encode()
                os.write(w, b"E" + struct.pack("<I", len(msg)) + msg)
            except OSError:
                pass
        finally:
            os._exit(code)
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


def run_workers(fn, args_list: list, timeout: float, on_ready=None) -> list:
    """Forks one process per args; each runs fn(ready, *args) and returns a picklable result.
    ``ready()`` tells the parent this child is set up and returns the common start time
    (perf_counter_ns) once every child is ready; ``on_ready()`` runs in the parent then."""
    go_r, go_w = os.pipe()
    shared = mmap.mmap(-1, 8)

    def child(w, *args):
        os.close(go_w)

        def ready() -> int:
            _send(w, b"R")
            if os.read(go_r, 1) != b"G":
                raise RuntimeError("parent went away")
            return struct.unpack("<q", shared[:8])[0]

        _send(w, b"D", pickle.dumps(fn(ready, *args)))

    kids = []
    deadline = time.monotonic() + timeout
    try:
        for args in args_list:
            kids.append(fork_child(child, *args))
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
    return results


def sleep_until(t_ns: int) -> None:
    while True:
        left = t_ns - pc()
        if left <= 0:
            return
        time.sleep(min(left / 1e9, 0.01) if left > 2_000_000 else 0)
