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
from typing import Any

from .logs import say

__all__ = ["EventLog", "TorchEventHandler"]


class EventLog:
    """Appends events (one ``write`` per line, ``O_APPEND``: agents sharing a log dir never
    interleave mid-line) and publishes the node's status through the handler."""

    def __init__(self, path: str | None, host: str, handler: Any, metrics: Any = None) -> None:
        self._fd: int | None = None
        self._host, self._handler, self.metrics = host, handler, metrics
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
