"""The elastic agent: one node's worker group through rounds of the rendezvous.

``Agent`` takes its parts from outside (the rendezvous handler, the fork server factory, the
clock) and reacts to events from one wait point (a selector): a worker exited (its status socket
from the fork server), the round must be replaced (a thread blocked in the handler's
``watch_round``), a signal came (``wakeup.py``), the fork server died; with heartbeats, the
selector's timeout reads the heartbeat board.

- A worker failed, or stopped beating (``hangs.py``: its stacks are shown first): end the round
  for everyone at once (``end_round``), stop the local group, rendezvous again; each such failure
  spends one of ``max_restarts``.
- The round ended elsewhere (a node lost or waiting, a failure on another node): stop the local
  group and rendezvous again, without spending the budget.
- Every worker succeeded: close the run as finished (its run id is refused from then on), exit
  at once; an agent hosting a store first serves until every participant finished (at most
  ``drain_timeout``, and it says so). A node whose round ends while a peer finished keeps
  waiting for its own workers: a finished peer is never taken for a lost one.
- SIGTERM/SIGINT/...: forwarded to the workers, SIGKILL after ``shutdown_timeout``.
- The rendezvous closed by an operator (``elasticstore stop``): stop the workers, report "stopped
  by operator", exit 0; an agent hosting the store first serves until the others left.

Every step is an event (``events.py``): events.jsonl, the status record, the metrics."""

from __future__ import annotations

import functools
import os
import selectors
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

from ..rendezvous.api import AgentRendezvous, as_agent_rendezvous
from ..rendezvous.closing import FINISHED
from . import drain
from .config import AgentSettings
from .envs import worker_argv, worker_env
from .events import EventLog
from .failures import Failure, exits_of, failure_of, summary
from .forkclient import ForkServer, settle_preloads
from .hangs import Hang, HangWatch
from .health import HealthGate
from .logs import open_rank_log, rank_output, run_log_dir, say
from .logspecs import reify
from .platforms import PlatformHooks
from .rounds import RendezvousCall, assign, say_moves, say_round
from .roundwatch import RoundWatcher
from .snapshots import SnapshotArea
from .wakeup import SignalWakeup
from .workers import Worker, WorkerGroup, WorkerSpec, signal_name

__all__ = ["Agent"]

_SUCCEEDED, _FAILED, _ROUND, _SIGNAL = "succeeded", "failed", "round", "signal"


class Agent:
    # Failure restarts so far (the last round's TORCHELASTIC_RESTART_COUNT), and whether this
    _restart_count = _spent = 0  # node spent one since (rounds.assign: one count on every node)
    def __init__(
        self,
        settings: AgentSettings,
        handler: RendezvousHandler | AgentRendezvous,
        server_factory: Callable[[bool], ForkServer] = ForkServer,
        clock: Callable[[], float] = time.monotonic,
        metrics: Any = None,
    ) -> None:
        self.s = settings
        # Called through the Protocol only; a handler without elasticstore's parts is adapted.
        self.handler = as_agent_rendezvous(handler, settings.monitor_interval)
        self._server_factory = server_factory
        self._clock = clock
        self._server: ForkServer | None = None
        self._group: WorkerGroup | None = None
        self._tmp = tempfile.mkdtemp(prefix=f"elasticstore_{settings.run_id}_") if not settings.log_dir else None
        # Per-rank files: under --log-dir, else (as torchrun's) under the temporary directory for -r/-t.
        redirected = any(settings.redirects.values()) or any(settings.tee.values())
        self._log_root = settings.log_dir or (self._tmp if redirected else None)
        self._run_dir: str | None = None  # below the log root: <run_id> or <run_id>_<random>
        self._failures_used = self._local_attempts = self._rounds = self._moves_seen = 0
        self._failures: list[Failure] = []
        self._platform = PlatformHooks()  # the file timer, the launcher's error file
        # _moves_seen: store moves said; _closing: saw the run closed; _refused: finished before
        self._shut = self._operator_stopped = self._closing = self._refused = False
        self._rdzv_thread: threading.Thread | None = None
        self.events = EventLog(settings.log_dir, settings.run_id, settings.host, self.handler, metrics,
                               self.s.nproc, clock, settings.role)

    # -- the whole run ------------------------------------------------------------------------

    def run(self) -> int:
        """Runs the job on this node; returns the exit code of the launcher."""
        self._wakeup = SignalWakeup(self.s.signals)
        self._sig_r = self._wakeup.sock
        start = self._clock()
        if self._log_root and not self.s.log_dir:
            say(f"[elasticstore-run] log directory set to: {self._log_root} (-r/-t without --log-dir)")
        self._snapshots = SnapshotArea(self.s.run_id)  # kept across rounds, removed at the end
        if self.events.metrics is not None:
            self.events.metrics.snapshot_area(self._snapshots.path)
        self._hangs = HangWatch(self._snapshots.path or tempfile.gettempdir(), self.s.nproc,
                                self.s.heartbeat_timeout, self.s.first_heartbeat_timeout, self.s.host,
                                self.handler.peer_statuses)
        self._server = self._server_factory(self.s.warm)
        self._health = HealthGate(
            self.s.health, self.s.nproc,
            {**os.environ, **dict(self.s.extra_env), "TORCHELASTIC_RUN_ID": self.s.run_id},
            self.events, self.handler, self._sig_r, self._live_server, self._clock)
        code = 1
        try:
            self._platform.start()
            code = self._platform.ended(self._loop())
        except Exception as exc:
            if self._stopped_by_operator():
                if self._rounds == 0:  # closed before this node's first round: a reused run id?
                    say(f"[elasticstore-run] {exc}")
                code = self._operator_stop()
            else:  # finished before this node's first round: it stood by, or it is refused
                finished = self._rounds == 0 and self._run_finished()
                spare = finished and drain.stood_by(self.handler)
                self._refused = finished and not spare
                say("[elasticstore-run] the job finished while this node stood by" if spare else
                    f"[elasticstore-run] {exc}" if self._refused else
                    f"[elasticstore-run] {type(exc).__name__}: {exc}")
                if not spare:
                    self._platform.launcher_failed(exc)
                code = 0 if spare else 1
        finally:
            self._stop_group(signal.SIGKILL if self._group is None else signal.SIGTERM)
            self._server.close()
            self._hangs.close()
            self._snapshots.close(self._wakeup.grace_left(code, self.s.shutdown_timeout))
            self._platform.close()
            # The last status while the rendezvous connection is ours (no rendezvous thread uses it).
            if not self._shut and not self._refused and not (
                    self._rdzv_thread and self._rdzv_thread.is_alive()):
                self.events.publish(state=self._verdict(code))
                if self._closing:  # the others must still read why the run closed
                    drain.serve_until_left(self.handler, self.s.drain_timeout, self._wakeup.pending)
            self._shutdown_handler()
            self._wakeup.close()
            self.events.torch_event("STOPPED" if self._operator_stopped else
                                    "SUCCEEDED" if code == 0 else "FAILED")
            self.events.close()
        verdict = self._verdict(code)
        say(f"[elasticstore-run] job {self.s.run_id} on {self.s.host} {verdict}: {self._rounds} "
            f"round(s), {self._failures_used}/{self.s.max_restarts} restart(s) after failures, "
            f"{self._clock() - start:.1f}s")
        return code

    def _loop(self) -> int:
        for _ in range(1 << 30):
            sig, t0 = self._health.gate(self._rounds, self._failures_used), self._clock()  # health.py
            info = sig or self._rendezvous()
            if isinstance(info, int):
                return 128 + info
            self._rounds += 1
            self._moves_seen = say_moves(self.handler, self.events, self._moves_seen)
            attempt, base, world = self._assign(info)
            t1, formed_at = self._clock(), time.time()
            self._start(info, attempt, base, world)
            self._snapshots.replicate(info, attempt, self.s)  # the round's replica ring
            say_round(self.handler, info, base, world, self.s.nproc, t1 - t0, self._clock() - t1)
            assert self._group is not None
            self.events.round_formed(self.handler.round, self._rounds, info.rank,
                                     info.world_size, (base, base + self.s.nproc - 1), world,
                                     t1 - t0, formed_at, self._group.workers)
            outcome, detail = self._watch(info, attempt)
            self.events.round_ended()
            if outcome in (_FAILED, _ROUND) and self._stopped_by_operator():
                return self._operator_stop()
            if outcome == _SUCCEEDED:
                self._finish(info, attempt)
                return 0
            if outcome == _SIGNAL:
                say(f"[elasticstore-run] got {signal.Signals(detail).name}: stopping the workers")
                self.events.emit("stop", reason=f"signal {signal.Signals(detail).name}")
                self._stop_group(detail)
                return 128 + detail
            stopped = self._stop_group(signal.SIGTERM)
            if outcome == _FAILED:
                real = exits_of(self._failures, stopped)  # a hung rank's real signal
                if real != self._failures:
                    self._failures = real
                    self.events.failure(real)
                # As torchrun: the report lists the workers stopped because of the failure too.
                self._failures += [failure_of(w, self.s.host) for w in stopped if w.exit_code
                                   not in (None, 0) and w.pid not in {f.pid for f in self._failures}]
                if self._failures_used >= self.s.max_restarts:
                    say(summary(self.s.entrypoint, self._failures))
                    self._platform.failed(self._failures)
                    self._close_rendezvous()
                    return 1
                self._failures_used += 1
                self._spent = 1  # the next round's restart count is one more (rounds.assign)
                self.events.publish(failure_restarts=self._failures_used)
                say(f"[elasticstore-run] {detail}; restart {self._failures_used}/{self.s.max_restarts}")
            else:
                say(f"[elasticstore-run] {detail}: new round (no restart spent)")
        return 1

    # -- a round ------------------------------------------------------------------------------

    def _rendezvous(self) -> RendezvousInfo | int:
        """``next_rendezvous`` in a thread, so a signal is handled at once; int: the signal."""
        call = RendezvousCall(self.handler, self._server if self.s.warm and not self._rounds else None)
        self._rdzv_thread = call.thread
        return call.wait(self._sig_r)

    def _assign(self, info: RendezvousInfo) -> tuple[int, int, int]:
        """(attempt, first global rank here, world size) (``rounds.assign``); the round's
        restart count (``TORCHELASTIC_RESTART_COUNT``) in ``_restart_count``."""
        rnd = self.handler.round
        attempt = rnd.round - 1 if rnd is not None else self._local_attempts
        self._local_attempts += 1
        base, world, self._restart_count = assign(info, attempt, self.s.nproc,
                                                  self._restart_count + self._spent)
        self._spent = 0
        return attempt, base, world

    def _start(self, info: RendezvousInfo, attempt: int, base: int, world: int) -> None:
        self._server = settle_preloads(self._live_server(), self.events, self.handler.share_imports)
        logs = self._log_root or self._tmp or "."
        if self._run_dir is None:
            self._run_dir = run_log_dir(logs, self.s.run_id, self.s.log_layout)
        root = os.path.join(logs, self._run_dir, f"attempt_{attempt}")
        self._hangs.new_round(attempt, multi_node=world > self.s.nproc)
        specs = []
        for local in range(self.s.nproc):
            rank = base + local
            rank_dir = os.path.join(root, str(local if self.s.log_layout == "torchrun" else rank))
            if self._log_root:  # checked before any worker starts: a refused path starts none
                for stream in ("stdout", "stderr"):
                    os.close(open_rank_log(self._log_root, rank_dir, f"{stream}.log"))
            error_file = os.path.join(rank_dir, "error.json")
            argv, kind = worker_argv(self.s, local)
            env = worker_env(self.s, info, self.handler.use_agent_store, attempt, local, rank,
                             world, error_file, self._restart_count)
            env.update(self._snapshots.env(), **self._hangs.env(local), **self._platform.worker_env())
            specs.append(WorkerSpec(local, rank, argv, env, kind, error_file,
                                    rank_dir if self._log_root else None))
        specs = reify(self.s, specs)  # --logs-specs: the files its LogsDest names (logspecs.py)
        for tries in range(2):
            self._group = WorkerGroup(self._server, self._clock)
            try:
                self._group.start(specs, os.getcwd(), functools.partial(rank_output, self.s, self._log_root))
                return
            except (RuntimeError, OSError) as exc:
                self._stop_group(signal.SIGKILL)
                if tries:
                    raise
                say(f"[elasticstore-run] {exc}: starting a new fork server")
                self._server.close()
                self._server = self._server_factory(self.s.warm)

    def _live_server(self) -> ForkServer:
        """The fork server, a new one when it died."""
        assert self._server is not None
        if not self._server.alive():
            say("[elasticstore-run] the fork server died: starting a new one")
            self._server.close()
            self._server = self._server_factory(self.s.warm)
        return self._server

    # -- the wait point -----------------------------------------------------------------------

    def _watch(self, info: RendezvousInfo, attempt: int) -> tuple[str, Any]:
        assert self._group is not None and self._server is not None
        wake_r, wake_w = socket.socketpair()
        watcher = RoundWatcher(self.handler, wake_w)
        try:
            with selectors.DefaultSelector() as sel:
                self._group.register(sel)
                sel.register(self._sig_r, selectors.EVENT_READ)
                sel.register(wake_r, selectors.EVENT_READ)
                sel.register(self._server.control, selectors.EVENT_READ)
                for _ in range(1 << 40):
                    if (hang := self._hangs.check(self._group.running())) is not None:
                        return self._hung(hang)
                    self.events.ranks(self._hangs.report_due(self._group.workers))
                    if (progress := self._hangs.progress_due(self._group.running())) is not None:
                        self.events.publish(progress=progress)
                    for key, _ in sel.select(self._hangs.poll_interval()):
                        obj = key.fileobj
                        if obj is self._sig_r:
                            return _SIGNAL, self._sig_r.recv(64)[0]
                        if obj is self._server.control:
                            return self._failed("the fork server died", None)
                        if obj is wake_r:
                            sel.unregister(wake_r)
                            if self._run_finished() or self.handler.peers_done(info, attempt):
                                continue  # a peer finished: only our workers are left to finish
                            return _ROUND, "the round ended (a node was lost, joined or failed)"
                        worker = key.data
                        self._group.collect(worker, sel)
                        self.events.worker_exited(worker)
                        if worker.exit_code != 0:
                            return self._failed(
                                f"rank {worker.spec.rank} (pid {worker.pid}) failed with "
                                f"{signal_name(worker.exit_code)}", worker)
                        if not self._group.running():
                            return _SUCCEEDED, None
            return _FAILED, "the wait point gave up"
        finally:
            watcher.stop()
            wake_r.close()
            wake_w.close()

    def _failed(self, what: str, worker: Any) -> tuple[str, Any]:
        ended_elsewhere = self._ended_elsewhere()
        try:
            self.handler.end_round(f"{what} on {self.s.host}")
        except Exception as exc:
            say(f"[elasticstore-run] could not end the round: {exc}")
        if worker is not None:
            if ended_elsewhere:  # the others' failure came first: ours is its consequence
                return _ROUND, f"{what} after the round ended elsewhere"
            assert self._group is not None
            self._failures = [failure_of(w, self.s.host) for w in self._group.workers
                              if w.exit_code not in (None, 0)]
            self.events.failure(self._failures)
        return _FAILED, what

    def _hung(self, hang: Hang) -> tuple[str, Any]:
        """A worker stopped beating: its stacks to the console (and log), then as a failure."""
        assert self._group is not None
        self._hangs.report(hang, self._group.workers, self._log_root)
        self.events.emit("hang", **hang.event)
        outcome = self._failed(hang.what, None)
        self._failures = [hang.failure]
        self.events.failure(self._failures)
        return outcome

    def _ended_elsewhere(self) -> bool:  # a peer's death may reach a worker before the watcher
        try:
            return self.handler.num_nodes_waiting() > 0 or self.handler.member_lost()
        except Exception:
            return False

    # -- the end ------------------------------------------------------------------------------

    def _finish(self, info: RendezvousInfo, attempt: int) -> None:
        drain.mark_finished(self.handler)  # first: a peer whose round ends now reads it
        self._stop_group(signal.SIGKILL)  # what the workers' trees left behind
        self.events.publish(state="succeeded")
        drain.finish(info, attempt, self.handler, self.s.drain_timeout, self._clock,
                     self._wakeup.pending, self._shutdown_handler)

    def _shutdown_handler(self) -> None:
        if self._shut:
            return
        self._shut = True
        try:
            self.handler.shutdown()
        except Exception as exc:
            say(f"[elasticstore-run] rendezvous shutdown: {exc}")

    def _stop_group(self, sig: int) -> list[Worker]:
        """Stops the workers still running; returns them (their exits collected)."""
        group, self._group = self._group, None
        if group is None:
            return []
        return group.stop_reporting(self.s.shutdown_timeout, sig,
                                    lambda w: self.events.worker_exited(w, stopped=True))

    # -- what the outside sees (events.jsonl, the status record, metrics) ----------------------

    def _verdict(self, code: int) -> str:
        if self._operator_stopped:
            return "stopped by operator"
        if self._refused:
            return "refused (the run id finished before)"
        return "succeeded" if code == 0 else f"failed (exit code {code})"

    def _stopped_by_operator(self) -> bool:
        return drain.closed_reason(self.handler) == "stopped by operator"

    def _run_finished(self) -> bool:  # a node's workers succeeded: the run is closed as finished
        return drain.closed_reason(self.handler) == FINISHED

    def _operator_stop(self) -> int:
        say("[elasticstore-run] the rendezvous was closed: stopped by operator; stopping the workers")
        self._operator_stopped = self._closing = True
        self._stop_group(signal.SIGTERM)
        self.events.emit("stop", reason="stopped by operator")
        self.events.publish(state="stopped by operator")
        return 0

    def _close_rendezvous(self) -> None:
        self._closing = True
        try:
            self.handler.set_closed()
        except Exception as exc:
            say(f"[elasticstore-run] could not close the rendezvous: {exc}")
