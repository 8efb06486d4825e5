"""What an agent tells the outside: one JSON line per event in ``<log-dir>/<run_id>/events.jsonl``
(with ``mono`` and ``wall`` timestamps), its status record in the rendezvous store (for
``elasticstore status``) and, when enabled, its Prometheus metrics (``metrics.py``).

Events: ``round_formed``, ``worker_started``, ``worker_exited``, ``restart`` (cause
``worker_failure``, ``node_lost`` or ``node_joined``), ``node_lost``, ``node_joined``, ``stop``,
and ``torch`` (torch's own elastic events, with ``--event-log-handler``). Nothing here may fail the
job: a write that fails is reported once and dropped.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .logs import say
from .workers import Worker, signal_name

__all__ = ["EventLog", "TorchEventHandler"]


class EventLog:
    """Appends events (one ``write`` per line, ``O_APPEND``: agents sharing a log dir never
    interleave mid-line) and publishes the node's status through the handler."""

    def __init__(self, path: str | None, host: str, handler: Any, metrics: Any = None,
                 nproc: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self._fd: int | None = None
        self._host, self._handler, self.metrics = host, handler, metrics
        self._nproc, self._clock = nproc, clock
        self._members: tuple[str, ...] = ()
        self._ended_at: float | None = None  # when the last round ended here (time to recover)
        self._lock = threading.Lock()
        self._warned = False
        self.status: dict[str, Any] = {"host": host, "state": "starting", "failure_restarts": 0}
        if path:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

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
        publish = getattr(self._handler, "publish_status", None)
        if publish is None:
            return
        try:
            publish(dict(self.status), failure)
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

    def round_ended(self) -> None:
        self._ended_at = self._clock()

    def worker_exited(self, worker: Worker, stopped: bool = False) -> None:
        """One event (and metric) per worker exit; ``stopped``: the agent stopped it."""
        code = worker.exit_code
        self.emit("worker_exited", rank=worker.spec.rank, pid=worker.pid, exit_code=code,
                  how=signal_name(code) if code is not None else None, stopped=stopped)
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
    """Sends torch's events for ``destination`` to ``log`` (and keeps torch's own handler)."""
    from torch.distributed.elastic import events as torch_events

    logger = torch_events._get_or_create_logger(destination)  # torch's per-destination logger
    logger.addHandler(TorchEventHandler(log))
