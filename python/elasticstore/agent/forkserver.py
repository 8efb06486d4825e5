"""The process that starts an agent's workers: a fork server (warm start) or a plain launcher.

The agent starts it once (``forkclient.ForkServer``): a copy of the launcher forked before it
started anything, which calls ``run_forked``, or a fresh interpreter that runs this file as a
script (standard library only, so ``--plain`` never imports torch). With ``--preload`` it has torch
imported (never CUDA, never user code) and then forks each worker, which runs the script or module
as ``__main__`` in the state a fresh ``python -u script.py`` (``-m mod``) starts in and ends as
that interpreter would: a restart pays neither a new interpreter nor ``import torch``. With
``--plain`` it forks and ``exec``s the command (``--start-method spawn``, ``--no-python``).

Containment: this process is the workers' parent and a child subreaper (orphans of a worker's
tree come to it and are reaped). Each worker leads its own session and process group and has a
parent-death signal (SIGKILL). This process has a parent-death signal (SIGTERM) on the agent: when
the agent dies, even by SIGKILL, it kills every worker's process group and its remaining children
and exits; it does the same when the agent closes the control socket. Other signals sent to the
agent's process group (Ctrl-C, ``timeout``) are the agent's to act on: this process ignores them.

Unless the agent turns it off, warm workers report the third-party packages they import
(``importreport.py``), which this process preloads when idle (``preload.py``) while a copy of it
forked before the import began (``standin.py``) serves the agent: a restart never waits for an
import, and no fork is ever taken from a module imported in part. A worker's exit during such an
import is reported from the SIGCHLD handler. Workers run ``warmrun.py``; see ``forkclient.py``."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.util
import json
import os
import select
import selectors
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import preload as _preload_module

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# Imported by the fork server before its first fork, so that no worker pays for them again.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.elastic.multiprocessing.errors")
# A guess (an optimizer imports torch._dynamo: 1.4-3 s) imported behind a stand-in (standin.py)
# UNFORKED_PRELOAD_S after the start without a fork (a standby: idle CPUs), or first when taught a
# job's list; after a fork, once a worker imported it (no learner: when idle). Trusted: no probe.
DEFERRED_PRELOAD = ("torch._dynamo",)
IDLE_PRELOAD_S = 0.5
UNFORKED_PRELOAD_S = 3.0
_MAX_MSG = 1 << 20


def prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value})")


# -- the server process ------------------------------------------------------------------------


class _Server:
    def __init__(self, ctl: socket.socket, preload: bool, agent: int,
                 learner: _preload_module.Preloader | None = None) -> None:
        self.ctl, self.preload, self.agent = ctl, preload, agent
        self.deferred = list(DEFERRED_PRELOAD) if preload else []
        self.workers: dict[int, socket.socket] = {}
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self.learner = learner  # workers report their imports to it (preload.py)
        self.forked, self.idle, self.started = False, False, time.monotonic()  # idle: importing
        self.notes = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # standin.py
        self.notes[0].setblocking(False)
        self.stand_in: Any = None  # serves the agent while this process imports
        self.adopted = self.adopted_at = 0  # workers its stand-ins forked: all, at its start

    def serve(self) -> dict[str, Any] | None:
        """Serves until the agent goes; returns in a forked child with the job to run."""
        signal.set_wakeup_fd(self.wake_w.fileno())
        signal.signal(signal.SIGCHLD, self._on_child_exit)
        self.sel.register(self.ctl, selectors.EVENT_READ)
        self.sel.register(self.wake_r, selectors.EVENT_READ)
        learner = self.learner
        if learner is not None:
            self.sel.register(learner.pipe_r, selectors.EVENT_READ)
        while True:
            idle_work = self.deferred or (learner is not None and learner.pending)
            ready = self.sel.select(self._idle_wait() if idle_work else None)
            job = None if ready else self._idle_work()
            if job is not None:
                return job
            for key, _ in ready:
                if learner is not None and key.fileobj == learner.pipe_r:
                    learner.drain()
                    if self.forked:  # a worker imported the guess: trusted, imported first
                        self.deferred = [n for n in DEFERRED_PRELOAD
                                         if n in learner.known and n not in sys.modules]
                    continue
                if key.fileobj is self.wake_r:
                    sigs = self.wake_r.recv(512)
                    self._reap()
                    # SIGTERM is the agent's death signal; any other SIGTERM/SIGINT/... was sent
                    # to the agent's process group (Ctrl-C, timeout, a scheduler): the agent
                    # decides how the workers stop (SIGTERM, grace, SIGKILL), not this process.
                    if any(s != signal.SIGCHLD for s in sigs) and os.getppid() != self.agent:
                        self._kill_all()
                        return None
                    continue
                try:
                    msg, fds, _, _ = socket.recv_fds(self.ctl, _MAX_MSG, 4)
                except OSError:
                    msg, fds = b"", []
                if not msg:  # the agent closed the socket or died
                    self._kill_all()
                    return None
                request = json.loads(msg)
                if request.get("op") == "ready":  # answered once what every worker gets is here
                    for fd in fds:
                        with contextlib.suppress(OSError):
                            os.write(fd, b"ready")
                        os.close(fd)
                    continue
                if request.get("op") in ("preload", "teach", "names"):  # sent only to a learner
                    while request["op"] == "teach" and self.deferred and learner is not None:
                        _import(self.deferred.pop(0))  # a node that joins a job: all of it now
                        learner.rebase()  # what the fork server itself imports is trusted
                    for fd in fds if learner is None else learner.request(request, fds):
                        os.close(fd)
                    continue
                job = self._fork(request, fds)
                if job is not None:
                    return job

    def _idle_wait(self) -> float:
        """Before the first fork, a node whose round is near keeps its CPUs a while longer."""
        since = 0.0 if self.forked else self.started + UNFORKED_PRELOAD_S - time.monotonic()
        return max(IDLE_PRELOAD_S, since)

    def _idle_work(self) -> dict[str, Any] | None:
        """Imports (the deferred preload, or what the workers reported) while a stand-in forked
        before serves the agent (``standin.py``): a restart never waits for an import. Returns
        the job in a worker that the stand-in forked."""
        learner, stand_in = self.learner, None
        if learner is None or learner.unsafe() is None:  # else: it forks no more anyway
            stand_in = _STANDIN.StandIn(self.notes, _MAX_MSG)
            job = stand_in.fork(self.ctl, self._prepare)
            if job is not None:
                return job
        self.idle, self.stand_in, self.adopted_at = True, stand_in, self.adopted
        try:
            if self.deferred:
                _import(self.deferred.pop(0))
                if learner is not None:  # what the fork server itself imports is trusted
                    learner.rebase()
            elif learner is not None:
                learner.work(self._busy)
        finally:
            if stand_in is not None:
                stand_in.stop(self.workers)
            self.idle, self.stand_in = False, None
        return None

    def _prepare(self, job: dict[str, Any], fds: list[int]) -> None:
        """In a worker forked by a stand-in: what ``_fork`` does in its child."""
        job["fds"], job["status"] = fds[1:], fds[0]
        job["imports"] = self.learner.pipe_w if self.learner is not None else None
        self._close_in_child(None)

    def _on_child_exit(self, *_: object) -> None:  # runs between an idle import's bytecodes
        if self.idle:  # so an exit is not reported after the errors it causes elsewhere
            self._reap(workers_only=True)

    def _busy(self) -> bool:
        """Asked during idle work: reports workers' exits at once (the agent reacts to a
        failure without waiting for a preload); True: the agent wants something (with a
        stand-in: it forked a worker, or it is gone, as when the agent closed the socket): the
        preload gives way after the import in progress (the rest waits for the next idle time)."""
        try:
            if self.wake_r.recv(512):
                self._reap(workers_only=True)  # not a probe: it waits for its own child
        except BlockingIOError:
            pass
        if self.stand_in is not None:  # it forked a worker: the CPUs are the new round's
            self.adopted += _STANDIN.take_notes(self.notes[0], self.workers)
            return self.adopted > self.adopted_at or not self.stand_in.alive()
        return bool(select.select([self.ctl], [], [], 0)[0])

    def _fork(self, job: dict[str, Any], fds: list[int]) -> dict[str, Any] | None:
        status = socket.socket(fileno=fds[0])
        unsafe = self.learner.unsafe() if self.learner is not None else None
        if unsafe is not None:
            # Forking a process with threads is unsafe: the agent starts a fresh fork server.
            with contextlib.suppress(OSError):
                status.send(f"refused: not safe to fork ({unsafe})".encode())
            status.close()
            for fd in fds[1:]:
                os.close(fd)
            return None
        # Everything imported so far moves to the collector's permanent generation: a worker's
        # collections (and its exit) never traverse torch's objects, and never write to their
        # pages, which then stay shared with this process (Python's advice for fork without exec).
        gc.freeze()
        self.forked = self.forked or not job.get("check")  # a health check's: no idle work yet
        if self.forked and self.learner is not None:
            self.deferred.clear()  # its workers report what they import: no guess
        pid = os.fork()
        if pid == 0:
            job["fds"] = fds[1:]
            job["parent"] = os.getppid()
            job["status"] = os.dup(status.fileno())  # the child says "pid" once it leads its group
            job["imports"] = self.learner.pipe_w if self.learner is not None else None
            self._close_in_child(status)
            return job
        for fd in fds[1:]:
            os.close(fd)
        self.workers[pid] = status
        return None

    def _close_in_child(self, status: socket.socket | None) -> None:
        signal.set_wakeup_fd(-1)
        self.sel.close()
        for sock in (self.ctl, self.wake_r, self.wake_w, *self.notes, *self.workers.values()):
            sock.close()
        if status is not None:
            status.close()
        if self.learner is not None:
            os.close(self.learner.pipe_r)

    def _reap(self, workers_only: bool = False) -> None:
        self.adopted += _STANDIN.take_notes(self.notes[0], self.workers)  # first: all known
        if workers_only:
            for pid in list(self.workers):
                try:
                    found, wstatus = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    continue
                if found == pid:
                    self._reaped(pid, wstatus)
            return
        for _ in range(100_000):
            try:
                pid, wstatus = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._reaped(pid, wstatus)

    def _reaped(self, pid: int, wstatus: int) -> None:
        sock = self.workers.pop(pid, None)
        if sock is not None:  # else: an orphan of a worker's tree, adopted and now reaped
            with contextlib.suppress(OSError):
                sock.send(f"exit {os.waitstatus_to_exitcode(wstatus)}".encode())
            sock.close()

    def _kill_all(self) -> None:
        for pid in list(self.workers):
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            children = _children()
            if not children:
                break
            for pid in children:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            self._reap()
            time.sleep(0.01)
        self._reap()


def _children() -> list[int]:
    pids: list[int] = []
    task_dir = f"/proc/{os.getpid()}/task"
    for tid in os.listdir(task_dir):
        with contextlib.suppress(OSError), open(f"{task_dir}/{tid}/children") as f:
            pids.extend(int(p) for p in f.read().split())
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
    for sig, disposition in _STARTED_WITH.items():
        signal.signal(sig, disposition)
    for target, fd in enumerate(job["fds"]):  # stdin (the launcher's), stdout, stderr
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    os.chdir(job["cwd"])
    cpus = job["env"].get("ELASTICSTORE_CPU_AFFINITY")
    if cpus:  # --numa-binding (numa.py): before the script, so every thread and child inherits it
        os.sched_setaffinity(0, {c for part in cpus.split(",") for lo, _, hi in [part.partition("-")]
                                 for c in range(int(lo), int(hi or lo) + 1)})


def _exec(job: dict[str, Any]) -> None:
    argv = job["argv"]
    try:
        os.execvpe(argv[0], argv, job["env"])
    except OSError as exc:
        os.write(2, f"elasticstore: cannot run {argv[0]!r}: {exc}\n".encode())
    os._exit(127)


def _import(name: str) -> None:
    try:
        importlib.import_module(name)
    except Exception as exc:  # the worker then imports it itself (and reports it)
        print(f"elasticstore fork server: preloading {name} failed: {exc}", file=sys.stderr)


def _sibling(stem: str) -> Any:
    """``<stem>.py`` beside this file (this process runs as a script, outside the package)."""
    name = f"_elasticstore_forkserver_{stem}"
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{stem}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_FRESH: Any = None  # freshstate.py
_STANDIN: Any = None  # standin.py
_WARM: Any = None  # warmrun.py
_PRELOAD: Any = None  # preload.py, when the workers' imports are preloaded
_REPORT: Any = None  # importreport.py, then
_STARTED_WITH: dict[int, Any] = {}  # the signal dispositions a worker starts with


def main() -> dict[str, Any] | None:
    """As a script (a fresh interpreter): ``forkserver.py --preload|--plain CTL_FD AGENT OPTIONS``."""
    del sys.path[0]  # this file's directory: never on a worker's path
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    return serve_agent(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), options)


def serve_agent(mode: str, ctl_fd: int, agent: int, options: dict[str, Any]) -> dict[str, Any] | None:
    """Serves the agent on ``ctl_fd`` until it goes (returns None) or returns in a forked
    worker with its job (then ``_WARM.run`` runs it). ``sys.path`` is the path a fresh
    interpreter starts with (the workers' path is made from it)."""
    global _FRESH, _PRELOAD, _REPORT, _STANDIN, _WARM
    _FRESH, _STANDIN, _WARM = _sibling("freshstate"), _sibling("standin"), _sibling("warmrun")
    startup_path = list(sys.path)
    _STARTED_WITH.update(_FRESH.worker_signals(options.get("signals", {})))  # before it changes
    # Signals to the agent's process group are the agent's to act on (serve() ignores them too).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, lambda *_: None)
    _FRESH.set_title([f"elasticstore-forkserver (agent {agent})"])
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != agent:
        return None
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    ctl = socket.socket(fileno=ctl_fd)
    learner = None
    if mode == "--preload":
        for name in PRELOAD:
            _import(name)
        if options.get("learn"):
            _PRELOAD, _REPORT = _sibling("preload"), _sibling("importreport")
            learner = _PRELOAD.Preloader(_REPORT.third_party_origin,
                                         refused=dict(options.get("refused", {})))
    job = _Server(ctl, mode == "--preload", agent, learner).serve()
    if job is not None:
        job["forked_at"] = time.time()
        job["path"], job["pythonpath"] = startup_path, os.environ.get("PYTHONPATH")
        _enter_worker(job)
        if mode == "--plain" or job["kind"] == "exec":
            _exec(job)
    return job


def run_forked(mode: str, ctl_fd: int, agent: int, options: dict[str, Any]) -> int:
    """In a copy of the agent forked before it started anything (``forkclient.ForkServer``
    with ``fork=True``): serves as ``main`` does, then runs the worker's job in a worker.
    Returns only in the server, when the agent went (the caller exits with the code)."""
    job = serve_agent(mode, ctl_fd, agent, options)
    if job is not None:
        _WARM.run(job, _FRESH, _REPORT)  # never returns
    return 0


if __name__ == "__main__":
    _job = main()
    if _job is not None:
        _WARM.run(_job, _FRESH, _REPORT)
