"""What an agent tells the outside: one JSON line per event in ``<log-dir>/<run_id>/events.jsonl``
(with ``mono`` and ``wall`` timestamps), its status record in the rendezvous store (for
``elasticstore status``) and, when enabled, its Prometheus metrics (``metrics.py``).

Events: ``round_formed``, ``worker_started``, ``worker_exited``, ``restart`` (cause
``worker_failure``, ``node_lost`` or ``node_joined``), ``node_lost``, ``node_joined``, ``stop``,
``hang`` (``hangs.py``), ``health_check`` (``health.py``), ``preload``,
and ``torch`` (torch's own elastic events, with ``--event-log-handler``). Nothing here may fail the
job: a write that fails is reported once and dropped.

With ``--event-log-handler D`` (torchrun's flag) the agent also records what torch's own agent
records, through ``torch.distributed.elastic.events`` to destination ``D`` (``console`` prints
them, as torchrun does): ``torchelastic.worker.status.START`` per worker started, ``SUCCEEDED``,
``FAILED`` or ``TERMINATED`` per worker exit, and the agent's ``SUCCEEDED``, ``FAILED`` or
``STOPPED`` at its end. Every torch event for ``D`` is also routed into events.jsonl
(``{"event": "torch", "torch": {...}}``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..rendezvous.api import AgentRendezvous
from .logs import open_log, say
from .workers import Worker, signal_name

__all__ = ["EventLog", "TorchEventHandler"]


class EventLog:
    """Appends events (one ``write`` per line, ``O_APPEND``: agents sharing a log dir never
    interleave mid-line) and publishes the node's status through the handler."""

    def __init__(self, log_dir: str | None, run_id: str, host: str,
                 handler: AgentRendezvous | None,
                 metrics: Any = None, nproc: int = 1, clock: Callable[[], float] = time.monotonic,
                 role: str = "default") -> None:
        self._fd: int | None = None
        self._host, self._handler, self.metrics = host, handler, metrics
        self._nproc, self._clock = nproc, clock
        self._members: tuple[str, ...] = ()
        self._ended_at: float | None = None  # when the last round ended here (time to recover)
        self._lock = threading.Lock()
        self._warned = False
        self.torch_destination: str | None = None  # --event-log-handler (None: "null")
        self._run_id, self._backend, self._role, self._started = "", "", role, clock()
        if handler is not None:
            self._run_id, self._backend = _call(handler.get_run_id), _call(handler.get_backend)
        self.status: dict[str, Any] = {"host": host, "state": "starting", "failure_restarts": 0}
        if log_dir:  # <log_dir>/<run_id>/events.jsonl, no symbolic link followed below log_dir
            self._fd = open_log(log_dir, (run_id,), "events.jsonl")

    def emit(self, event: str, **fields: Any) -> None:
        if self._fd is None:
            return
        line = json.dumps({"event": event, "mono": time.monotonic(), "wall": time.time(),
                           "host": self._host, **fields}, default=str) + "\n"
        with self._lock:
            try:
                os.write(self._fd, line.encode())
            except OSError as exc:
                self._warn(f"events.jsonl: {exc}")

    def publish(self, failure: dict[str, Any] | None = None, **status: Any) -> None:
        """Updates this node's status record in the rendezvous store."""
        self.status.update(status)
        if self._handler is None:
            return
        try:
            self._handler.publish_status(dict(self.status), failure)
        except Exception as exc:
            self._warn(f"could not publish the status: {exc}")

    # -- the agent's steps ------------------------------------------------------------------------

    def round_formed(self, rnd: Any, rounds: int, node_rank: int, nodes: int, ranks: tuple[int, int],
                     world: int, took: float, formed_at: float, workers: Sequence[Worker]) -> None:
        """A round formed here (``rnd``: the handler's round record, None for other handlers) and
        its workers started; from the second round on, also the restart and its cause: a node of
        the previous round missing (node_lost), a new one (node_joined), else worker_failure."""
        number = rnd.round if rnd is not None else rounds
        members = tuple(rnd.participants) if rnd is not None else ()
        if rounds > 1:
            lost = sorted(set(self._members) - set(members))
            joined = sorted(set(members) - set(self._members))
            for node in lost:
                self.emit("node_lost", node=node, round=number)
            for node in joined:
                self.emit("node_joined", node=node, round=number)
            cause = "node_lost" if lost else "node_joined" if joined else "worker_failure"
            recover = self._clock() - self._ended_at if self._ended_at is not None else None
            self.emit("restart", cause=cause, round=number, recover_seconds=recover)
            if self.metrics is not None:
                self.metrics.restart(cause, recover)
        self._members = members
        self.emit("round_formed", round=number, world_size=nodes, workers=world,
                  node_rank=node_rank, ranks=list(ranks), rendezvous_seconds=took,
                  participants=list(members))
        for w in workers:
            self.emit("worker_started", round=number, rank=w.spec.rank,
                      local_rank=w.spec.local_rank, pid=w.pid)
        if self.metrics is not None:
            self.metrics.round(took, world)
        self.publish(state="running", round=number, group_rank=node_rank,
                     local_workers=self._nproc, ranks=list(ranks), formed_at=formed_at,
                     rendezvous_seconds=took, world_size=world)
        for w in workers:
            self.torch_event("START", w)

    def round_ended(self) -> None:
        self._ended_at = self._clock()

    def worker_exited(self, worker: Worker, stopped: bool = False) -> None:
        """One event (and metric) per worker exit; ``stopped``: the agent stopped it."""
        code = worker.exit_code
        self.emit("worker_exited", rank=worker.spec.rank, pid=worker.pid, exit_code=code,
                  how=signal_name(code) if code is not None else None, stopped=stopped)
        state = "SUCCEEDED" if code == 0 else "TERMINATED" if stopped else "FAILED"
        self.torch_event(state, worker, exit_code=code)
        if self.metrics is not None and code is not None:
            self.metrics.worker_exit(str(code) if code >= 0 else signal_name(code).split()[-1])

    def failure(self, failures: Sequence[Any]) -> None:
        """Publishes the root cause (the first failure by time) as the job's last failure."""
        if not failures:
            return
        f = min(failures, key=lambda x: x.when)
        self.publish(
            state="failed",
            failure={"rank": f.rank, "local_rank": f.local_rank, "host": f.host, "pid": f.pid,
                     "exit_code": f.exit_code, "how": f.how, "when": f.when,
                     "message": f.message, "error_file": f.error_file})

    def ranks(self, report: dict[str, dict[str, Any]] | None) -> None:
        """The beating workers' step times (``hangs.HangWatch.report_due``): into the status
        record (``elasticstore status`` marks stragglers job-wide) and the metrics."""
        if report is None:
            return
        self.publish(ranks=report)
        if self.metrics is not None:
            self.metrics.ranks(report)

    def torch_event(self, state: str, worker: Worker | None = None,
                    exit_code: int | None = None) -> None:
        """Records ``torchelastic.worker.status.<state>`` (a worker's, or with no worker the
        agent's) as torch's agent does, to ``torch_destination``."""
        if self.torch_destination is None:
            return
        from torch.distributed.elastic.events import Event, EventSource, record

        md: dict[str, Any] = {"group_world_size": self.status.get("world_size")}
        meta: dict[str, Any] = {
            "run_id": self._run_id, "global_rank": None, "group_rank": self.status.get("group_rank"),
            "worker_id": None, "role": self._role, "hostname": self._host, "state": state,
            "total_run_time": int(self._clock() - self._started), "rdzv_backend": self._backend,
            "raw_error": None, "agent_restarts": self.status.get("failure_restarts"),
            "duration_ms": None,
        }
        if worker is not None:
            md.update(local_rank=worker.spec.local_rank, exit_code=exit_code, worker_pid=worker.pid)
            meta.update(global_rank=worker.spec.rank, worker_id=str(worker.pid))
        else:
            meta["duration_ms"] = (self._clock() - self._started) * 1000
        meta["metadata"] = json.dumps(md)
        source = EventSource.WORKER if worker is not None else EventSource.AGENT
        try:
            record(Event(f"torchelastic.worker.status.{state}", source=source, metadata=meta),
                   self.torch_destination)
        except Exception as exc:
            self._warn(f"--event-log-handler {self.torch_destination}: {exc}")

    def _warn(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            say(f"[elasticstore-run] {what}")

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class TorchEventHandler(logging.Handler):
    """Routes torch's elastic events (``torch.distributed.elastic.events``) into the event log."""

    def __init__(self, log: EventLog) -> None:
        super().__init__()
        self._log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            payload: Any = json.loads(record.getMessage())
        except ValueError:
            payload = record.getMessage()
        self._log.emit("torch", torch=payload)


def route_torch_events(log: EventLog, destination: str) -> None:
    """Sends torch's events for ``destination`` to ``log`` (and keeps torch's own handler), and
    makes the agent record torch's agent events there."""
    from torch.distributed.elastic import events as torch_events

    logger = torch_events._get_or_create_logger(destination)  # torch's per-destination logger
    logger.addHandler(TorchEventHandler(log))
    log.torch_destination = destination


def _call(method: Callable[[], str]) -> str:
    try:
        return str(method())
    except Exception:
        return ""
