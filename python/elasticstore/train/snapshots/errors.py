"""What ``Snapshots`` raises, as subclasses of what callers already catch."""

from __future__ import annotations

import torch.distributed as dist

from ..sharded import ShardedStateError

__all__ = ["ShardedStateError", "SnapshotMismatchError", "SnapshotSpaceError"]


class SnapshotMismatchError(dist.DistError):
    """A restore found state that is not this rank's (another rank's per-rank state, another world
    size, another step, sharded state): refused rather than handed over."""


class SnapshotSpaceError(OSError):
    """The snapshot directory's file system has no room for a snapshot (reserved before the copy,
    so the worker gets this error instead of a bus error)."""
