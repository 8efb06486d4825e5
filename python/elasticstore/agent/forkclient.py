"""The agent's handle on its fork server (``forkserver.py``, run as a script): start it, ask it
for a worker, read a worker's exit status.

Protocol (AF_UNIX SOCK_SEQPACKET): the agent sends ``{"argv", "env", "cwd", "kind"}`` as JSON with
four descriptors (the worker's status socket, stdin, stdout, stderr); the worker itself writes
``pid N`` on the status socket once it leads its own process group (so the agent can signal the
group from then on), and the server writes ``exit CODE`` (negative: killed by signal -CODE) when
it reaped it.

Before a round the agent may instead send ``{"op": "preload"}`` with one descriptor: the server
replies on it with what it preloaded and refused since the last such request (``PreloadReport``'s
fields as JSON, ``preload.Preloader.report``); what it has not done yet it does when idle again.
``{"op": "teach", "names"}`` and ``{"op": "names"}``: the modules a running job's workers import,
taught to a joining node's server and read from a node's (``job_imports.py``).

Where the server comes from: a warm server is a copy of the launcher forked before the launcher
starts anything (``ForkServer(fork=True)``: torch, already imported by the launcher, is imported
once per node, and the first round never waits for a second import), else a fresh interpreter
running ``forkserver.py`` (a replacement server, a launcher run inside another program, an
interpreter with options of its own: ``fork_refusal``; ``ELASTICSTORE_FORK_SERVER=fresh``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from .job_imports import share_held
from .logs import say

__all__ = ["ForkServer", "PreloadReport", "fork_refusal", "read_status", "settle_preloads"]

SERVER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkserver.py")


@dataclass(frozen=True)
class PreloadReport:
    """What the fork server preloaded since the last report and what it refused (and why)."""

    preloaded: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    tainted: str | None = None
    unavailable: int = 0  # submodules not preloaded: ImportError (an optional dependency missing)
    submodules: int = 0  # preloaded submodules of the packages in ``preloaded``
    # preloaded although its import looked up worker variables (unset in the fork server)
    env_reads: dict[str, list[str]] = field(default_factory=dict)  # the server is no longer safe to fork (and forks no more)


# The launcher's signal dispositions as its workers would inherit them through exec ("ignore" or
# "default"), taken when this module is first imported: before the launcher handles any itself.
LAUNCHER_SIGNALS = {sig.name: "ignore" if signal.getsignal(sig) == signal.SIG_IGN else "default"
                    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                                signal.SIGINT)}


class ForkServer:
    """The agent's handle on the server process. ``preload``: warm start (fork server with torch
    imported); otherwise every worker is a fresh ``exec``. ``learn`` (warm start only): the
    server also preloads the third-party packages its workers imported; ``refused``: packages it
    must never preload (name -> why)."""

    def __init__(self, preload: bool, learn: bool = True,
                 refused: dict[str, str] | None = None, fork: bool = False) -> None:
        self.preload = preload
        self._forked = False  # whether a worker was ever asked for
        self.learn = learn and preload
        self.refused = dict(refused or {})
        self.sharing: Any = None  # job_imports.share_held's, once this node shares its list
        self.closed = threading.Event()
        self._ctl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mode = "--preload" if preload else "--plain"
        options = {"learn": self.learn, "refused": self.refused, "signals": LAUNCHER_SIGNALS}
        # How this server was made: "forked" (a copy of this process) or "fresh: <why not>".
        why = (fork_refusal() if preload else "plain workers") if fork else "asked for"
        self.origin = "forked" if why is None else f"fresh: {why}"
        self.proc: subprocess.Popen[bytes] | _ForkedServer
        try:
            if self.origin == "forked":
                self.proc = _ForkedServer(mode, theirs.fileno(), options)
            else:
                self.proc = subprocess.Popen(
                    [sys.executable, SERVER_SCRIPT, mode, str(theirs.fileno()), str(os.getpid()),
                     json.dumps(options)],
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                )
        finally:
            theirs.close()

    @property
    def control(self) -> socket.socket:
        """Readable only when the server died (it never writes on it)."""
        return self._ctl

    def start(self, argv: list[str], env: dict[str, str], cwd: str, kind: str,
              stdout: int, stderr: int, timeout: float = 300.0,
              stdin: int | None = None, check: bool = False) -> tuple[int, socket.socket]:
        """Starts a worker; returns its pid (== its process group) and its status socket.
        ``stdin``: the worker's standard input (None: /dev/null). ``check``: a health check's
        process, contained as a worker; not a first fork (the server's guess, ``torch._dynamo``,
        is still imported 3 s after its start without one)."""
        self._forked = True
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        null = os.open(os.devnull, os.O_RDONLY) if stdin is None else -1
        try:
            job = {"argv": argv, "env": env, "cwd": cwd, "kind": kind, "check": check}
            msg = json.dumps(job).encode()
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

    def ask(self, request: dict[str, Any], timeout: float) -> bytes | None:
        """Sends ``request`` (an ``op``) with a descriptor to answer on; the answer (at most
        1 MiB), or None when the server did not answer within ``timeout`` (or died)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            socket.send_fds(self._ctl, [json.dumps(request).encode()], [theirs.fileno()])
            theirs.close()
            mine.settimeout(timeout)
            return mine.recv(1 << 20)
        except OSError:
            return None
        finally:
            theirs.close()
            mine.close()

    def preloads(self, timeout: float = 600.0) -> PreloadReport | None:
        """What the server preloaded and refused since the last call (None: it did not
        answer); it never waits for an import in progress (its stand-in answers then)."""
        try:
            msg: dict[str, Any] = json.loads(self.ask({"op": "preload"}, timeout) or b"null") or {}
        except ValueError:
            return None
        if not msg:
            return None
        report = PreloadReport(
            preloaded=[str(n) for n in msg.get("preloaded", [])],
            refused={str(k): str(v) for k, v in msg.get("refused", {}).items()},
            seconds=float(msg.get("seconds", 0.0)), tainted=msg.get("tainted"),
            unavailable=int(msg.get("unavailable", 0)), submodules=int(msg.get("submodules", 0)),
            env_reads={str(k): [str(x) for x in v] for k, v in msg.get("env_reads", {}).items()})
        self.refused.update(report.refused)
        return report

    def wait_warm(self, timeout: float = 600.0) -> bool:
        """Blocks until the server has imported what it preloads for every worker (torch), so
        that a worker could be forked at once; False: it died or did not answer in time."""
        return self.ask({"op": "ready"}, timeout) == b"ready"

    def replacement(self) -> ForkServer:
        """A fresh server with the same settings, refusing what this one refused (a fresh
        interpreter: this process has threads now)."""
        return ForkServer(self.preload, self.learn, self.refused)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, timeout: float = 10.0) -> None:
        """The server kills what is left of every worker's tree and exits. A server that never
        forked has nothing to clean up: it is killed at once, not awaited (it may still be
        importing torch for seconds, as when a signal ends the job in its first rendezvous)."""
        self.closed.set()
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


def fork_refusal() -> str | None:
    """Why this process must not be copied into a fork server (None: it may). A copy is what a
    fresh interpreter running ``forkserver.py`` would be once it imported torch, only if this
    process runs nothing yet (one Python thread) and its interpreter had no options of its own
    (``-X``, ``-O``, ``-W``...: a fresh one would not have them)."""
    if threading.active_count() != 1 or threading.current_thread() is not threading.main_thread():
        return "the launcher runs threads already"
    if sys.orig_argv[1:2] not in (["-m"], [sys.argv[0]]):
        return f"the launcher's interpreter has options: {' '.join(sys.orig_argv[1:3])} ..."
    return None


class _ForkedServer:
    """A fork server forked from this process (``subprocess.Popen``'s calls that ``ForkServer``
    makes, as Popen makes them: ``waitpid``, so no pidfd and any Linux kernel). The child never
    returns into the caller's code: it serves, then exits."""

    def __init__(self, mode: str, ctl_fd: int, options: dict[str, Any]) -> None:
        agent = os.getpid()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
            if stream is not None:
                stream.flush()
        self.pid = os.fork()
        if self.pid == 0:
            _serve_in_child(mode, ctl_fd, agent, options)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): as subprocess does
                pid, status = self.pid, 0
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """As ``Popen.wait``: polls, with sleeps growing to 50 ms, until ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return code

    def kill(self) -> None:
        if self.returncode is None:  # not reaped yet: the pid is still this child's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _serve_in_child(mode: str, ctl_fd: int, agent: int, options: dict[str, Any]) -> NoReturn:
    """The forked copy: made to look like a fresh interpreter that ran ``forkserver.py`` (stdin
    /dev/null, no descriptor but stdio and the control socket, the path a fresh interpreter
    starts with), then the server; exits without returning into the launcher's code."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        keep = {0, 1, 2, ctl_fd}
        for fd in sorted(int(name) for name in os.listdir("/proc/self/fd")):
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if not getattr(sys.flags, "safe_path", False) and sys.path:  # PYTHONSAFEPATH (3.11)
            del sys.path[0]  # the launcher's script directory (-m: its working directory)
        import importlib.util

        spec = importlib.util.spec_from_file_location("_elasticstore_forkserver", SERVER_SCRIPT)
        assert spec is not None and spec.loader is not None
        server = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = server
        spec.loader.exec_module(server)
        code = server.run_forked(mode, ctl_fd, agent, options)
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        os._exit(code)


def read_status(sock: socket.socket) -> int | None:
    """The exit code from a worker's status socket (None: the server died first)."""
    try:
        data = sock.recv(256).decode()
    except OSError:
        return None
    return int(data[5:]) if data.startswith("exit ") else None


def settle_preloads(server: ForkServer, events: Any,
                    share: Callable[[list[str]], bool] | None = None) -> ForkServer:
    """Before a round's workers are forked: the server finishes preloading what the last
    round's workers imported; says what was preloaded and refused (a console line and a
    ``preload`` event). A server that is no longer safe to fork is replaced by a fresh one (its
    refusals carried over): the fresh one pays ``import torch`` once more before this round, and
    learns the packages again from this round's workers. ``share``
    (``AgentRendezvous.share_imports``): given the modules the server holds whenever it holds
    more (``job_imports.share_held``), for nodes that join later."""
    if not server.learn or not server.alive():
        return server
    report = server.preloads()
    if share is not None:  # now: something new was preloaded for this round
        share_held(server, share, now=bool(report and (report.preloaded or report.submodules)))
    if report is None or not (report.preloaded or report.submodules or report.refused
                              or report.tainted):
        return server
    packages, submodules = report.preloaded, report.submodules
    if packages or submodules:
        more = f" and {submodules} submodule(s)" if submodules else ""
        skipped = (f"; {report.unavailable} submodule(s) skipped (ImportError: an optional "
                   "dependency is missing)") if report.unavailable else ""
        say(f"[elasticstore-run] preloaded for this round: {', '.join(packages) or '-'}{more} "
            f"({report.seconds:.1f}s){skipped}")
    for name, variables in report.env_reads.items():
        say(f"[elasticstore-run] preloaded {name}, whose import looks up {', '.join(variables)}: "
            "it saw the fork server's environment, where they are unset (--no-preload-imports "
            "if it matters)")
    for name, why in report.refused.items():
        say(f"[elasticstore-run] not preloaded: {name}: {why}")
    events.emit("preload", preloaded=packages, submodules=submodules, refused=report.refused,
                unavailable=report.unavailable, env_reads=report.env_reads,
                seconds=report.seconds, tainted=report.tainted)
    if report.tainted is None:
        return server
    say(f"[elasticstore-run] the fork server is not safe to fork any more ({report.tainted}): "
        "starting a fresh one")
    server.close()
    return server.replacement()
