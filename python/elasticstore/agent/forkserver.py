"""The process that starts an agent's workers: a fork server (warm start) or a plain launcher.

The agent starts it once (``ForkServer``); it runs this file as a script (standard library only,
so ``--plain`` never imports torch). With ``--preload`` it imports torch (never CUDA, never user
code) and then forks each worker, which runs the script or module as ``__main__`` (``runpy``)
with its own argv, environment and working directory: a restart pays neither a new interpreter
nor ``import torch``. With ``--plain`` it forks and ``exec``s the command (``--start-method
spawn``, ``--no-python``).

Containment: this process is the workers' parent and a child subreaper (orphans of a worker's
tree come to it and are reaped). Each worker leads its own session and process group and has a
parent-death signal (SIGKILL). This process has a parent-death signal (SIGTERM) on the agent: when
the agent dies, even by SIGKILL, it kills every worker's process group and its remaining children
and exits; it does the same when the agent closes the control socket.

Protocol (AF_UNIX SOCK_SEQPACKET): the agent sends ``{"argv", "env", "cwd", "kind"}`` as JSON with
three descriptors (the worker's status socket, stdout, stderr); the worker itself writes ``pid N``
on the status socket once it leads its own process group (so the agent can signal the group from
then on), and the server writes ``exit CODE`` (negative: killed by signal -CODE) when it reaped it.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# Imported by the fork server before its first fork, so that no worker pays for them again.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.elastic.multiprocessing.errors")
# Imported once the first workers are forked and the server has been idle IDLE_PRELOAD_S: the next
# round's workers find them loaded, and the first round does not wait for them. torch._dynamo:
# creating a torch.optim optimizer imports it (1.4-3 s here), so nearly every training script does.
DEFERRED_PRELOAD = ("torch._dynamo",)
IDLE_PRELOAD_S = 0.5
_MAX_MSG = 1 << 20


def prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value})")


# -- the agent's side --------------------------------------------------------------------------


class ForkServer:
    """The agent's handle on the server process. ``preload``: warm start (fork server with torch
    imported); otherwise every worker is a fresh ``exec``."""

    def __init__(self, preload: bool) -> None:
        self.preload = preload
        self._ctl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mode = "--preload" if preload else "--plain"
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), mode, str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()

    @property
    def control(self) -> socket.socket:
        """Readable only when the server died (it never writes on it)."""
        return self._ctl

    def start(self, argv: list[str], env: dict[str, str], cwd: str, kind: str,
              stdout: int, stderr: int, timeout: float = 300.0) -> tuple[int, socket.socket]:
        """Starts a worker; returns its pid (== its process group) and its status socket."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            msg = json.dumps({"argv": argv, "env": env, "cwd": cwd, "kind": kind}).encode()
            socket.send_fds(self._ctl, [msg], [theirs.fileno(), stdout, stderr])
        finally:
            theirs.close()
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
        """The server kills what is left of every worker's tree and exits."""
        self._ctl.close()
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


# -- the server process ------------------------------------------------------------------------


class _Server:
    def __init__(self, ctl: socket.socket, preload: bool) -> None:
        self.ctl, self.preload = ctl, preload
        self.deferred = list(DEFERRED_PRELOAD) if preload else []
        self.workers: dict[int, socket.socket] = {}
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)

    def serve(self) -> dict[str, Any] | None:
        """Serves until the agent goes; returns in a forked child with the job to run."""
        signal.set_wakeup_fd(self.wake_w.fileno())
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, lambda *_: None)
        self.sel.register(self.ctl, selectors.EVENT_READ)
        self.sel.register(self.wake_r, selectors.EVENT_READ)
        while True:
            ready = self.sel.select(IDLE_PRELOAD_S if self.deferred and self.workers else None)
            if not ready and self.deferred:
                _import(self.deferred.pop(0))
            for key, _ in ready:
                if key.fileobj is self.wake_r:
                    sigs = self.wake_r.recv(512)
                    self._reap()
                    if any(s != signal.SIGCHLD for s in sigs):
                        self._kill_all()
                        return None
                    continue
                try:
                    msg, fds, _, _ = socket.recv_fds(self.ctl, _MAX_MSG, 3)
                except OSError:
                    msg, fds = b"", []
                if not msg:  # the agent closed the socket or died
                    self._kill_all()
                    return None
                job = self._fork(json.loads(msg), fds)
                if job is not None:
                    return job

    def _fork(self, job: dict[str, Any], fds: list[int]) -> dict[str, Any] | None:
        status = socket.socket(fileno=fds[0])
        # Everything imported so far moves to the collector's permanent generation: a worker's
        # collections (and its exit) never traverse torch's objects, and never write to their
        # pages, which then stay shared with this process (Python's advice for fork without exec).
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            job["fds"] = fds[1:]
            job["parent"] = os.getppid()
            job["status"] = os.dup(status.fileno())  # the child says "pid" once it leads its group
            self._close_in_child(status)
            return job
        os.close(fds[1])
        os.close(fds[2])
        self.workers[pid] = status
        return None

    def _close_in_child(self, status: socket.socket) -> None:
        signal.set_wakeup_fd(-1)
        self.sel.close()
        for sock in (self.ctl, self.wake_r, self.wake_w, status, *self.workers.values()):
            sock.close()

    def _reap(self) -> None:
        for _ in range(100_000):
            try:
                pid, wstatus = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            sock = self.workers.pop(pid, None)
            if sock is not None:  # else: an orphan of a worker's tree, adopted and now reaped
                try:
                    sock.send(f"exit {os.waitstatus_to_exitcode(wstatus)}".encode())
                except OSError:
                    pass
                sock.close()

    def _kill_all(self) -> None:
        for pid in list(self.workers):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            children = _children()
            if not children:
                break
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            self._reap()
            time.sleep(0.01)
        self._reap()


def _children() -> list[int]:
    pids: list[int] = []
    task_dir = f"/proc/{os.getpid()}/task"
    for tid in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{tid}/children") as f:
                pids.extend(int(p) for p in f.read().split())
        except OSError:
            pass
    return pids


def _enter_worker(job: dict[str, Any]) -> None:
    """In the forked child: own session, death signal, stdio, directory, environment."""
    os.setsid()
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != job["parent"]:
        os._exit(137)
    # Only now: the agent may signal the process group as soon as it has the pid.
    os.write(job["status"], f"pid {os.getpid()}".encode())
    os.close(job["status"])
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    out, err = job["fds"]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in (null, out, err):
        os.close(fd)
    os.chdir(job["cwd"])


def _run_warm(job: dict[str, Any]) -> None:
    """Runs the script or module as ``__main__``, as ``python script.py`` / ``python -m`` would."""
    import runpy

    os.environ.clear()
    os.environ.update(job["env"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # OpenMP read the variable when torch was loaded
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    argv = list(job["argv"])
    sys.argv = argv
    os.environ["ELASTICSTORE_FORKED_AT"] = repr(job["forked_at"])
    if job["kind"] == "module":
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        path = os.path.abspath(argv[0])
        sys.path[0] = os.path.dirname(path)
        runpy.run_path(path, run_name="__main__")


def _exec(job: dict[str, Any]) -> None:
    argv = job["argv"]
    try:
        os.execvpe(argv[0], argv, job["env"])
    except OSError as exc:
        os.write(2, f"elasticstore: cannot run {argv[0]!r}: {exc}\n".encode())
    os._exit(127)


def _import(name: str) -> None:
    import importlib

    try:
        importlib.import_module(name)
    except Exception as exc:  # the worker then imports it itself (and reports it)
        print(f"elasticstore fork server: preloading {name} failed: {exc}", file=sys.stderr)


def main() -> dict[str, Any] | None:
    mode, ctl_fd, agent = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    del sys.path[0]  # this file's directory: never on a worker's path
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != agent:
        return None
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    ctl = socket.socket(fileno=ctl_fd)
    if mode == "--preload":
        for name in PRELOAD:
            _import(name)
    job = _Server(ctl, mode == "--preload").serve()
    if job is not None:
        job["forked_at"] = time.time()
        _enter_worker(job)
        if mode == "--plain" or job["kind"] == "exec":
            _exec(job)
    return job


if __name__ == "__main__":
    _job = main()
    if _job is not None:
        _run_warm(_job)  # an uncaught exception or SystemExit ends the worker as in a script
