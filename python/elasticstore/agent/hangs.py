"""Hang detection: the agent reads its workers' heartbeats (``elasticstore.train.heartbeat``) from
shared memory and takes a worker that stops beating for a hang.

Each round gets a fresh board (``train/heartbeat_layout.py``): one file in the node's memory area,
one slot per local rank. A worker is judged only once it is known to beat:

- after its first beat, by ``heartbeat_timeout`` (time since its last beat, or since it left a
  section); inside ``section(name, timeout)`` by that section's timeout instead (none: never);
- before its first beat, by ``first_heartbeat_timeout`` (time since it started), and only once the
  script is known to beat (a worker of this agent beat before, in this round or an earlier one)
  and while no rank of the job has beaten in this round: once one has, the job makes progress,
  and a rank that never beats (a rank-0-only callback) is covered by the ones that do (they stop
  beating when it hangs). A script that never calls ``heartbeat()`` is never judged.

No verdict at all while a rank of the job is inside a section that has not expired: the others
may be waiting for it in a collective (rank 0 evaluates, the others wait in a barrier). This
node's ranks are read from the board; another node's from its progress entry in the store
(``progress.py``), read only when a verdict is due. Once the section ends, the ranks that waited
get a full timeout to beat again.

On a hang every local worker that registered its stack dump is asked for its Python stacks
(``faulthandler`` on ``STACK_SIGNAL``, written to a file per worker). Every rank blocked on a hung
peer stops beating too, so the stacks decide which rank is the hang: a silent rank whose main
thread is in torch's collectives or autograd waits on a peer; the others are hung themselves.
Once one rank is over its limit, every rank past half of its own is a suspect (peers blocked on a
hung rank went silent within a step of it, whichever crossed first); the hang is the
longest-silent suspect not waiting on a peer. When every silent rank here waits on a
peer and the job has ranks on other nodes, the cause is likely there: this agent waits one more
timeout for that node's agent to end the round before it ends it itself. The hung ranks are then
SIGKILLed (their stacks are taken; a stopped process gets no SIGTERM), the round is ended for every
node and a restart is spent; the failure names the rank, its host and how long it was silent.
"""

from __future__ import annotations

import mmap
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..train.heartbeat_layout import (
    BOARD_ENV,
    FLAG_STACKS,
    NO_DEADLINE,
    SLOT_BYTES,
    STACK_SIGNAL,
    STACKS_ENV,
    SlotView,
    read_slot,
)
from .failures import Failure
from .logs import open_rank_log, say
from .progress import LONG_SHARE, PeerProgress, local_progress, open_section, public, same
from .workers import Worker

__all__ = ["Hang", "HangWatch", "waits_on_peers"]

STACKS_WAIT_S = 1.0  # how long the agent waits for the asked stacks to be written
POLL_MIN_S, POLL_MAX_S = 0.05, 1.0  # how often the board is read: a tenth of the timeout, within these
SUSPECT_SHARE = 0.5  # once one worker is over its limit, those past this share of theirs are suspects
REPORT_EVERY_S = 5.0  # how often the ranks' step times go to the status record and the metrics
# Frames of a rank that waits for its peers (collectives, DDP's reducer inside backward).
PEER_WAIT_PATHS = ("/torch/distributed/", "/torch/autograd/", "/torch/nn/parallel/")


def waits_on_peers(stacks: str) -> bool:
    """Whether the main thread (faulthandler lists it last) is inside torch's collectives."""
    blocks = [b for b in stacks.split("\n\n") if "File " in b]
    if not blocks:
        return False
    frames = [ln.strip() for ln in blocks[-1].splitlines() if ln.strip().startswith("File ")]
    return bool(frames) and any(p in frames[0] for p in PEER_WAIT_PATHS)


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return round(ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2, 6)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


@dataclass
class Silent:
    worker: Worker
    view: SlotView
    seconds: float  # how long it has been silent
    why: str  # "no heartbeat for 3.2s (last at step 10)" and the like
    stacks: str = ""
    waiting: bool = False  # its stacks show it waits on a peer


@dataclass
class Hang:
    """The verdict: the hung rank(s) and what to tell the outside."""

    silent: list[Silent]
    culprit: Silent
    host: str
    failure: Failure
    stacks: dict[int, str]  # pid -> what faulthandler wrote, for every local worker asked
    event: dict[str, Any] = field(default_factory=dict)

    @property
    def what(self) -> str:
        w = self.culprit.worker
        return f"rank {w.spec.rank} (pid {w.pid}) hung: {self.culprit.why}"


class HangWatch:
    """The board of the current round and the judgement of its slots."""

    def __init__(self, directory: str, nproc: int, timeout: float | None,
                 first_timeout: float | None, host: str,
                 peers: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        self.dir, self.nproc, self.host = directory, nproc, host
        self.timeout, self.first_timeout = timeout, first_timeout
        self.multi_node = True
        self.beating_seen = False  # a worker of this agent has beaten (this round or before)
        self.progressed = False  # a rank of the job has beaten in this round
        limit = timeout or first_timeout or 0.0
        self._peers = PeerProgress(peers, limit * LONG_SHARE)  # the others' entries (progress.py)
        self._published: dict[str, Any] | None = None
        self._holding: str | None = None  # why no verdict is given now (said once)
        self._held_ns = 0  # when a verdict was last held: silence counts from then at the earliest
        self._map: mmap.mmap | None = None
        self._files: list[str] = []
        self._round = 0
        self._started = 0.0
        self._deferred_until: float | None = None
        self._next_report = 0.0

    @property
    def enabled(self) -> bool:
        return self.timeout is not None or self.first_timeout is not None

    def new_round(self, attempt: int, multi_node: bool) -> None:
        """A fresh board for the round's workers (the last round's is removed)."""
        self.close()
        self._round, self.multi_node = attempt, multi_node
        path = os.path.join(self.dir, f"heartbeats.{attempt}.{os.getpid()}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, self.nproc * SLOT_BYTES)
            self._map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self._files = [path]
        self._started = time.monotonic()
        self._deferred_until = None
        self.progressed, self._published, self._holding, self._held_ns = False, None, None, 0

    def env(self, local_rank: int) -> dict[str, str]:
        if self._map is None:
            return {}
        stacks = os.path.join(self.dir, f"stacks.{self._round}.{os.getpid()}.{local_rank}")
        self._files.append(stacks)
        return {BOARD_ENV: self._files[0], STACKS_ENV: stacks}

    def poll_interval(self) -> float | None:
        """Seconds until the board should be read again (None: never)."""
        if self._map is None:
            return None
        timeouts = [t for t in (self.timeout, self.first_timeout) if t is not None]
        return min(POLL_MAX_S, max(POLL_MIN_S, min(timeouts) / 10)) if timeouts else POLL_MAX_S

    def report_due(self, workers: list[Worker]) -> dict[str, dict[str, Any]] | None:
        """Every REPORT_EVERY_S, each beating worker's step (beats), median step time and
        median time in sections per step (the straggler view), and how long it has been silent;
        None when not due or nothing beats."""
        now = time.monotonic()
        if self._map is None or now < self._next_report:
            return None
        self._next_report = now + REPORT_EVERY_S
        out: dict[str, dict[str, Any]] = {}
        for w in workers:
            v = self.slot(w.spec.local_rank)
            if v is None or not v.beats or w.exit_code is not None:
                continue
            out[str(w.spec.rank)] = {
                "step": v.beats, "step_seconds": _median(v.steps),
                "work_seconds": _median(v.work) if any(v.work) else None,
                "silent_seconds": round(max(0.0, now - v.last_beat_ns / 1e9), 3),
                "section": v.section or None}
        return out or None

    def slot(self, local_rank: int) -> SlotView | None:
        return read_slot(self._map, local_rank) if self._map is not None else None

    def _silence(self, w: Worker, now_ns: int, share: float = 1.0) -> Silent | None:
        """``w`` silent past ``share`` of the limit that applies to it (1.0: it is over it)."""
        view = self.slot(w.spec.local_rank)
        assert view is not None
        if view.beats:
            self.beating_seen = True
        if view.section_until_ns == NO_DEADLINE:
            return None
        if view.section_until_ns:
            allowed = (view.section_until_ns - view.section_from_ns) / 1e9
            ran = (now_ns - view.section_from_ns) / 1e9
            if ran <= allowed * share:
                return None
            return Silent(w, view, ran, f"section {view.section!r} ran {ran:.1f}s, over its "
                          f"timeout of {allowed:g}s (after step {view.beats})")
        if view.beats == 0:  # judged only while no rank of the job has beaten in this round
            quiet = now_ns / 1e9 - max(self._started, self._held_ns / 1e9)
            if self.first_timeout is None or not self.beating_seen or self.progressed or \
                    quiet <= self.first_timeout * share:
                return None
            return Silent(w, view, quiet, f"no first heartbeat {quiet:.1f}s after it started "
                          f"(--first-heartbeat-timeout {self.first_timeout:g}s)")
        quiet = (now_ns - max(view.last_beat_ns, self._held_ns)) / 1e9
        if self.timeout is None or quiet <= self.timeout * share:
            return None
        return Silent(w, view, quiet, f"no heartbeat for {quiet:.1f}s (last at step {view.beats}; "
                      f"--heartbeat-timeout {self.timeout:g}s)")

    def check(self, running: list[Worker]) -> Hang | None:
        """The hang among ``running``, if any (asks for stacks: call only when a verdict matters).

        No verdict while a rank of the job is inside a section that has not expired (the others
        may wait for it in a collective; a multi-node job asks the other nodes' progress entries,
        ``progress.py``). Once one worker is over its limit, every worker past ``SUSPECT_SHARE``
        of its own is a suspect too: ranks blocked in a collective on a hung peer went silent
        within a step of it, and whichever crossed first, the stacks tell them apart."""
        if self._map is None or not self.enabled:
            return None
        now_ns = time.monotonic_ns()
        views = [(w.spec.rank, self._view(w)) for w in running]
        if any(v.beats for _, v in views):
            self.beating_seen = self.progressed = True
        over = [s for w in running if (s := self._silence(w, now_ns)) is not None]
        if over and self.multi_node and not self.progressed and \
                all(s.view.beats == 0 for s in over) and self._peers.beaten(self._round):
            self.progressed = True  # a rank elsewhere beats: the job makes progress
            over = [s for s in over if s.view.beats > 0]
        if not over and self._holding is None:
            self._deferred_until = None
            return None
        # While a verdict is held, the hold is looked at on every poll: once it ends, the ranks
        # that waited get a full timeout to beat again (silence counts from _held_ns).
        held = open_section(views, now_ns) or (
            self._peers.open_section(self._round) if self.multi_node else None)
        if held is not None:
            self._deferred_until, self._held_ns = None, now_ns
            if self._holding is None and over:
                say(f"[elasticstore-run] rank {over[0].worker.spec.rank} silent ({over[0].why}): "
                    f"no verdict while {held}")
            self._holding = held
            return None
        self._holding = None
        if not over:
            return None
        if self._deferred_until is not None and time.monotonic() < self._deferred_until:
            return None
        silent = [s for w in running if (s := self._silence(w, now_ns, SUSPECT_SHARE)) is not None]
        stacks = self._take_stacks(running)
        for s in silent:
            s.stacks = stacks.get(s.worker.pid, "")
            s.waiting = waits_on_peers(s.stacks)
        own = [s for s in silent if not s.waiting]
        if not own and self.multi_node and self._deferred_until is None:
            self._deferred_until = time.monotonic() + (self.timeout or POLL_MAX_S)
            return None  # every silent rank waits on a peer: the cause is likely on another node
        culprit = max(own or silent, key=lambda s: s.seconds)
        if not own:
            mute = [r for r, v in views if v.beats == 0 and not v.section_until_ns]
            culprit.why += " (it waits in a collective: no rank of this node is hung itself" + (
                f"; rank(s) {', '.join(map(str, mute))} never beat, so no stacks show where "
                "they are)" if mute else ")")
        return self._verdict(silent, culprit, stacks)

    def _view(self, w: Worker) -> SlotView:
        view = self.slot(w.spec.local_rank)
        assert view is not None
        return view

    def progress_due(self, running: list[Worker]) -> dict[str, Any] | None:
        """This node's progress entry for its status record (``progress.py``) when it changed
        (a multi-node job only: nobody else reads it); else None."""
        limit = self.timeout or self.first_timeout
        if self._map is None or not self.multi_node or limit is None:
            return None
        entry = local_progress(self._round, [(w.spec.rank, self._view(w)) for w in running],
                               limit * LONG_SHARE, time.monotonic_ns())
        if same(self._published, entry):
            return None
        self._published = entry
        return public(entry)

    def _take_stacks(self, running: list[Worker]) -> dict[int, str]:
        """Asks every local worker that can for its stacks; {pid: text} (stopped ones: a note)."""
        asked: dict[int, tuple[str, int]] = {}  # pid -> (its stacks file, its size before)
        texts: dict[int, str] = {}
        for w in running:
            view = self.slot(w.spec.local_rank)
            path = w.spec.env.get(STACKS_ENV)
            if _state(w.pid) == "T":
                texts[w.pid] = "(the process is stopped: SIGSTOP or a debugger; no stacks)"
            elif view is not None and view.flags & FLAG_STACKS and path:
                try:
                    before = os.path.getsize(path)
                    os.kill(view.pid, STACK_SIGNAL)
                    asked[w.pid] = (path, before)
                except OSError:
                    pass
        deadline = time.monotonic() + STACKS_WAIT_S
        for _ in range(1000):  # until every asked worker wrote something, or the deadline
            if all(_size(path) > before for path, before in asked.values()) or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.02)
        time.sleep(0.05)  # faulthandler writes thread by thread: let the last one finish
        for pid, (path, before) in asked.items():
            try:
                with open(path, "rb") as f:
                    f.seek(before)
                    texts[pid] = f.read().decode("utf-8", "replace")
            except OSError:
                texts[pid] = ""
        return texts

    def _verdict(self, silent: list[Silent], culprit: Silent, stacks: dict[int, str]) -> Hang:
        for s in silent:
            if not s.waiting:
                try:  # its stacks are taken; a stopped process would not act on SIGTERM
                    os.kill(s.worker.pid, signal.SIGKILL)
                except OSError:
                    pass
        w = culprit.worker
        message = f"hung: {culprit.why}"
        trace = "\n".join(f"rank {s.worker.spec.rank} (pid {s.worker.pid}):\n{stacks.get(s.worker.pid, '')}"
                          for s in sorted(silent, key=lambda s: s is not culprit))
        failure = Failure(w.spec.rank, w.spec.local_rank, self.host, w.pid, -signal.SIGKILL,
                          time.time() - 1e-3, message, trace, None)
        event = {"rank": w.spec.rank, "local_rank": w.spec.local_rank, "pid": w.pid,
                 "silent_seconds": round(culprit.seconds, 3), "step": culprit.view.beats,
                 "section": culprit.view.section or None, "why": culprit.why,
                 "silent_ranks": [s.worker.spec.rank for s in silent],
                 "waiting_ranks": sorted(s.worker.spec.rank for s in silent if s.waiting)}
        return Hang(silent, culprit, self.host, failure, stacks, event)

    def stacks_text(self, hang: Hang, running: list[Worker]) -> str:
        """What the console and the log show: every local worker's stacks, the hung one first."""
        order = [hang.culprit.worker] + [w for w in running if w is not hang.culprit.worker]
        texts = hang.stacks
        lines = []
        for w in order:
            text = texts.get(w.pid, "")
            role = "hung" if w is hang.culprit.worker else (
                "waits on a peer" if waits_on_peers(text) else "peer")
            lines.append(f"--- stacks of rank {w.spec.rank} (local {w.spec.local_rank}, pid {w.pid}, "
                         f"{role}) ---")
            lines.extend((text or "(no stacks: it does not beat, or did not answer)").rstrip().splitlines())
        return "\n".join(lines)

    def report(self, hang: Hang, workers: list[Worker], log_root: str | None) -> None:
        """The hang and every local worker's stacks to the console and, with a log directory, to
        the hung rank's ``stacks.log``."""
        text = self.stacks_text(hang, workers)
        say(f"[elasticstore-run] {hang.what} on {self.host}; the stacks of this node's workers:\n{text}")
        rank_dir = hang.culprit.worker.spec.log_dir
        if rank_dir and log_root:
            try:
                fd = open_rank_log(log_root, rank_dir, "stacks.log")
                try:
                    os.write(fd, text.encode() + b"\n")
                finally:
                    os.close(fd)
            except OSError as exc:
                say(f"[elasticstore-run] could not write the stacks to {rank_dir}: {exc}")

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        for path in self._files:
            try:
                os.unlink(path)
            except OSError:
                pass
        self._files = []
