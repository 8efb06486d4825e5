"""Replicas of each node's sharded snapshots on another node, carried by the agents: a ring over
the round's nodes (``service.py``), the step they agree to send and the workers hold
(``schedule.py``), a sender thread (``sender.py``), a receiving endpoint (``receiver.py``) and
their wire (``wire.py``). Restore reads what arrived in the snapshot area's
``replicas/`` (``train/snapshots/sharded_restore.py``). See docs/training.md."""

from __future__ import annotations

from .receiver import KEEP_STEPS, Receiver
from .sender import Sender
from .service import ReplicaService
from .wire import ReplicaError

__all__ = ["KEEP_STEPS", "Receiver", "ReplicaError", "ReplicaService", "Sender"]
