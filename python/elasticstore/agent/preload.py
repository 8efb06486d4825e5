"""Preloading what the workers imported: each warm worker tells its fork server the third-party
packages it imports (``importreport.py``), which it imports for the next round's workers.

The fork server must stay safe to fork: no thread may appear in it and CUDA must stay untouched.
Each batch of reported packages is first imported in a throwaway child of the fork server (a
probe) that compares its Python and native threads (``/proc/self/task``) before and after each
import, checks ``torch.cuda.is_initialized()`` and whether the CUDA driver got loaded, and checks
the package is the one the worker loaded; the fork server then imports only what passed, checking
the same again. A package that fails is refused, with the reason; a fork server that still got a
thread (an import that starts one only sometimes) is "tainted": it forks no more and the agent
replaces it (``forkclient.settle_preloads``).

Standard library only: the fork server (run as a script) loads this file by its path.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.machinery import ModuleSpec
from typing import Any

# importreport.third_party_origin: where a top-level module was found, if third-party
Locate = Callable[[ModuleSpec, list[str]], "str | None"]

__all__ = ["Locate", "Preloader", "Verdict", "native_threads"]

MAX_NAME = 200  # longer reported names are ignored (no module is named like that)
MAX_REPORT = 4000  # bytes of one report line (importreport.MAX_REPORT)
MAX_PACKAGES = 50_000  # distinct module names a fork server takes from its workers
MAX_LISTED = 500  # names of each kind in one report to the agent (the rest are not named)
SHARED_BYTES = 96 * 1024  # the names of what was preloaded, in one report (for other nodes)
TEACH_BUDGET_S = 60.0  # the longest a fork server imports what it is taught before it serves
REPORT_PIPE_BYTES = 1 << 20  # the report pipe's buffer (Linux's F_SETPIPE_SZ)
PROBE_TIMEOUT_S = 300.0  # a probe that imports for longer is killed and its package refused
PR_SET_PDEATHSIG = 1
POLL_S = 0.05  # how often a probe asks whether the fork server has other work


def native_threads() -> int:
    """The threads of this process as the kernel counts them (native ones included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _python_threads() -> int:
    threading = sys.modules.get("threading")
    return threading.active_count() if threading is not None else 1


def _cuda_state() -> tuple[bool, bool]:
    """(torch initialised CUDA, the CUDA driver library is mapped into this process)."""
    torch = sys.modules.get("torch")
    initialised = False
    if torch is not None and hasattr(torch, "cuda"):
        try:
            initialised = bool(torch.cuda.is_initialized())
        except Exception:
            initialised = False
    try:
        with open("/proc/self/maps") as f:
            driver = "libcuda.so" in f.read()
    except OSError:
        driver = False
    return initialised, driver


@dataclass
class Verdict:
    name: str
    refused: str | None  # why, or None: preloaded
    env_reads: list[str] = field(default_factory=list)  # worker variables its import looked up


# What the agent sets for each worker (envs.worker_env) and so differs between workers or rounds:
# the fork server's environment has none of them, and a module that reads one at import keeps
# what it saw there.
WORKER_VARIABLES = frozenset({
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "ELASTICSTORE_ADDR", "ELASTICSTORE_HOST", "ELASTICSTORE_PORT", "ELASTICSTORE_PREFIX",
    "ELASTICSTORE_RUN_ID", "ELASTICSTORE_TOKEN_FILE", "ELASTICSTORE_ATTEMPT",
})


def _record_env_reads(reads: list[str]) -> None:
    """From now on (a probe), every lookup of a worker variable in ``os.environ`` (``[]``,
    ``get``, ``in``, ``os.getenv``) is appended to ``reads``."""
    base = type(os.environ)

    class Recording(base):  # type: ignore[valid-type, misc]
        def __getitem__(self, key: str) -> str:
            if key in WORKER_VARIABLES:
                reads.append(key)
            return base.__getitem__(self, key)  # type: ignore[no-any-return]

    os.environ.__class__ = Recording


_IMPORT_FAILED = "its import failed: "
_IMPORT_ERRORS = (f"{_IMPORT_FAILED}ImportError:", f"{_IMPORT_FAILED}ModuleNotFoundError:")


def checked_import(name: str, origin: str | None, locate: Locate) -> str | None:
    """Imports ``name``; returns why it must not stay in a fork server (None: fine)."""
    import importlib

    if name in sys.modules:
        return None
    before = (_python_threads(), native_threads())
    cuda_before = _cuda_state()
    try:
        module = importlib.import_module(name)
    except BaseException as exc:  # noqa: BLE001 - a package's import may raise anything
        return f"{_IMPORT_FAILED}{type(exc).__name__}: {str(exc)[:200]}"
    after = (_python_threads(), native_threads())
    if after[0] > before[0] or after[1] > before[1]:
        threading = sys.modules.get("threading")
        names = [t.name for t in threading.enumerate()][1:] if threading is not None else []
        return (f"its import started a thread ({after[1] - before[1]} native, "
                f"{after[0] - before[0]} Python{': ' + ', '.join(names[-3:]) if names else ''})")
    cuda = _cuda_state()
    if cuda[0] and not cuda_before[0]:
        return "its import initialised CUDA"
    if cuda[1] and not cuda_before[1]:
        return "its import loaded the CUDA driver"
    spec = getattr(module, "__spec__", None)
    found = locate(spec, sys.path) if spec is not None else None
    if origin is not None and found != origin:
        return f"the fork server finds it at {found}, the worker at {origin}"
    return None


def _probe_child(names: list[tuple[str, str | None]], out: int, locate: Locate) -> None:
    """In the probe: import in order, one verdict line each, stop at the first refusal."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    reads: list[str] = []
    _record_env_reads(reads)
    for name, origin in names:
        why = checked_import(name, origin, locate)
        verdict = {"name": name, "refused": why, "env_reads": sorted(set(reads))}
        os.write(out, (json.dumps(verdict) + "\n").encode())
        reads.clear()
        if why is not None:
            break


def probe(names: list[tuple[str, str | None]], stop: Callable[[], bool], locate: Locate,
          timeout: float = PROBE_TIMEOUT_S) -> tuple[list[Verdict], bool]:
    """Imports ``names`` in a forked child of this process: (the verdicts up to and including
    the first refusal (the rest must be probed again without it), whether it ran to its end).
    ``stop()``, asked every ``POLL_S``: True ends the probe at once (the fork server has work)."""
    import ctypes

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            _probe_child(names, w, locate)
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    ended = stopped = False
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(r, selectors.EVENT_READ)
        while not ended and time.monotonic() < deadline:
            if sel.select(min(POLL_S, max(0.0, deadline - time.monotonic()))):
                chunk = os.read(r, 65536)
                ended = not chunk
                data += chunk
            if not ended and stop():
                stopped = True
                break
    os.close(r)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # the fork server's own reaping took it
        pass
    lines = data.decode().splitlines()
    if stopped and lines and not data.endswith(b"\n"):
        lines.pop()  # cut short mid-line
    verdicts = [Verdict(v["name"], v["refused"], v["env_reads"]) for v in map(json.loads, lines)]
    if stopped:
        return verdicts, False
    if len(verdicts) < len(names) and (not verdicts or verdicts[-1].refused is None):
        name = names[len(verdicts)][0]
        verdicts.append(Verdict(name, f"its import did not end within {timeout:.0f}s or "
                                      "ended the process"))
    return verdicts, True


@dataclass
class Preloader:
    """The fork server's side: what its workers reported, what it preloaded and refused.
    ``locate``: ``importreport.third_party_origin`` (checks a package is the worker's)."""

    locate: Locate

    refused: dict[str, str] = field(default_factory=dict)  # every refusal (given at start too)
    pending: list[tuple[str, str | None]] = field(default_factory=list)
    known: set[str] = field(default_factory=set)
    preloaded: list[str] = field(default_factory=list)  # since the last report
    new_refused: dict[str, str] = field(default_factory=dict)  # since the last report
    # Submodules whose import raised ImportError (an optional dependency not installed), since
    unavailable: int = 0  # the last report: the worker's own import failed too; not named
    # Since the last report: preloaded although its import looked up worker variables (unset)
    env_reads: dict[str, list[str]] = field(default_factory=dict)
    seconds: float = 0.0
    tainted: str | None = None  # why this process must not fork any more
    baseline: int = field(default_factory=native_threads)  # when the fork server was ready
    pipe_r: int = -1  # the workers write their reports on pipe_w (one line each)
    pipe_w: int = -1
    _partial: bytes = b""

    def __post_init__(self) -> None:
        self.pipe_r, self.pipe_w = os.pipe()
        os.set_blocking(self.pipe_r, False)
        os.set_blocking(self.pipe_w, False)  # a worker drops a report rather than wait
        try:
            fcntl.fcntl(self.pipe_w, fcntl.F_SETPIPE_SZ, REPORT_PIPE_BYTES)
        except (AttributeError, OSError):
            pass

    def rebase(self) -> None:
        """The fork server imported something of its own (trusted): its threads are the norm."""
        self.baseline = max(self.baseline, native_threads())

    def unsafe(self) -> str | None:
        """Why this process must not fork (None: it may)."""
        if self.tainted is None and native_threads() > self.baseline:
            self.tainted = f"{native_threads()} threads, {self.baseline} when it was ready"
        return self.tainted

    def drain(self) -> None:
        """Reads the workers' reports waiting in the pipe."""
        for _ in range(100_000):
            try:
                data = os.read(self.pipe_r, 1 << 16)
            except OSError:  # none left
                return
            if not data:
                return
            *lines, self._partial = (self._partial + data).split(b"\n")
            for line in lines:
                self.note(line)
            if len(self._partial) > MAX_REPORT:
                self._partial = b""

    def note(self, line: bytes) -> None:
        """A worker's report (one line)."""
        try:
            msg = json.loads(line)
            name, origin = str(msg["name"]), msg.get("origin")
        except (ValueError, KeyError, TypeError):
            return
        self._add(name, origin if isinstance(origin, str) else None)

    def _add(self, name: str, origin: str | None) -> None:
        if (len(name) > MAX_NAME or not all(p.isidentifier() for p in name.split("."))
                or name in self.known or name.partition(".")[0] in self.refused
                or name in self.refused or len(self.known) >= MAX_PACKAGES):
            return
        self.known.add(name)
        if name not in sys.modules:
            self.pending.append((name, origin))

    def teach(self, names: object) -> None:
        """What the job's workers import on the other nodes: imported now, before this process
        serves (``TEACH_BUDGET_S`` at most; the rest when idle), checked as reports are; a name
        only where its top-level package is in a site directory here (``self.locate``)."""
        import importlib.util

        origins: dict[str, str | None] = {}
        for name in names[:MAX_PACKAGES] if isinstance(names, list) else []:
            top = name.partition(".")[0] if isinstance(name, str) else ""
            if not top.isidentifier():
                continue
            if top not in origins:
                try:
                    spec = getattr(sys.modules.get(top), "__spec__", None) or \
                        importlib.util.find_spec(top)
                except (ImportError, ValueError):
                    spec = None
                origins[top] = self.locate(spec, sys.path) if spec is not None else None
            if origins[top] is not None:
                self._add(name, origins[top] if name == top else None)
        deadline = time.monotonic() + TEACH_BUDGET_S
        self.work(lambda: time.monotonic() > deadline)

    def request(self, msg: dict[str, Any], fds: list[int]) -> list[int]:
        """An agent's request (to a learner), answered on ``fds[0]``: ``preload`` (``answer``),
        ``teach`` (``done`` once imported), ``names`` (the reported modules this process holds,
        sorted; ``SHARED_BYTES`` of them at most). Returns the descriptors to close."""
        if msg.get("op") == "preload":
            return self.answer(fds)
        if msg.get("op") == "teach":
            self.teach(msg.get("names"))
        held = sorted(n for n in self.known if n in sys.modules)
        sizes = itertools.accumulate(len(n) + 4 for n in held)
        names = [n for n, size in zip(held, sizes) if size <= SHARED_BYTES]
        reply = b"done" if msg.get("op") == "teach" else json.dumps(names).encode()
        try:
            os.write(fds[0], reply)
        except (IndexError, OSError):
            pass
        return fds

    def work(self, stop: Callable[[], bool]) -> None:
        """Probes and imports the pending packages while the fork server is idle; ``stop()``
        True (the agent asks for a worker, or a worker exited) ends it before the next import
        (what is left stays pending)."""
        start = time.monotonic()
        while self.pending and self.tainted is None:
            batch = [(n, o) for n, o in self.pending if n not in sys.modules]
            self.pending = []
            if not batch:
                break
            verdicts, complete = probe(batch, stop, self.locate)
            done = 0
            for v in verdicts:
                why = v.refused
                if why is None and stop():
                    complete = False
                    break
                done += 1
                if why is None:
                    why = checked_import(v.name, dict(batch).get(v.name), self.locate)
                    if why is not None:
                        self.tainted = f"{v.name}: {why}"
                if why is None:
                    self.preloaded.append(v.name)
                    if v.env_reads:
                        self.env_reads[v.name] = v.env_reads
                elif "." in v.name and why.startswith(_IMPORT_ERRORS):
                    self.refused[v.name] = why
                    self.unavailable += 1
                else:
                    self.refused[v.name] = self.new_refused[v.name] = why
                if self.tainted is not None:
                    break
            self.pending = batch[done:] if self.tainted is None else []
            if not complete:
                break
        self.seconds += time.monotonic() - start
        if self.tainted is None and native_threads() > self.baseline:
            self.tainted = f"{native_threads()} threads, {self.baseline} when it started"

    def answer(self, fds: list[int]) -> list[int]:
        """The agent's request before a round: what was preloaded and refused since the last
        one, sent on ``fds[0]``; returns the other descriptors (to close). What is still
        pending is not done now (the round would wait for it, where its workers import it
        themselves) but once the server is idle again."""
        self.drain()
        with socket.socket(fileno=fds[0]) as reply:
            try:
                reply.send(json.dumps(self.report()).encode())
            except OSError:
                pass
        return fds[1:]

    def report(self) -> dict[str, Any]:
        """What changed since the last report (then forgotten, except the refusals): the
        top-level packages preloaded and how many submodules (one message: bounded)."""
        packages = [n for n in self.preloaded if "." not in n]
        refused = dict(list(self.new_refused.items())[:MAX_LISTED])
        out = {"preloaded": packages[:MAX_LISTED], "refused": refused,
               "submodules": len(self.preloaded) - len(packages),
               "unavailable": self.unavailable,
               "env_reads": dict(list(self.env_reads.items())[:MAX_LISTED]),
               "seconds": round(self.seconds, 3), "tainted": self.tainted}
        self.preloaded, self.new_refused, self.seconds, self.unavailable = [], {}, 0.0, 0
        self.env_reads = {}
        return out
