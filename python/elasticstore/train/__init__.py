"""What a training script touches: an elastic sampler, in-memory snapshots and atomic checkpoints.

``ElasticDistributedSampler`` orders each epoch the same at every world size, so a job that
resumes at another size (``state_dict``/``load_state_dict``) sees every sample once.
``save_checkpoint``/``load_checkpoint`` write and read checkpoints atomically;
``load_checkpoint_from_any_rank`` resumes from node-local directories. ``Snapshots`` copies the
state every step into the agent's shared memory and writes the disk checkpoints from it in the
background; its ``restore`` resumes from the newest step any node holds. ``heartbeat()`` (once
per step) and ``section()`` let the agent tell a hang from a long step. Nothing here imports the
agent or the rendezvous: it runs unchanged under ``torchrun``. See ``docs/training.md``.
"""

from __future__ import annotations

from .checkpoint import (
    Checkpoint,
    CheckpointConflictError,
    list_checkpoints,
    load_checkpoint,
    load_checkpoint_from_any_rank,
    save_checkpoint,
)
from .heartbeats import heartbeat, section
from .sampler import ElasticDistributedSampler
from .sharded import ShardedStateError
from .snapshots import (KEEP_PER_RANK, Restored, SnapshotMismatchError, SnapshotSettings,
                        SnapshotSpaceError, Snapshots)

__all__ = [
    "Checkpoint",
    "CheckpointConflictError",
    "ElasticDistributedSampler",
    "KEEP_PER_RANK",
    "Restored",
    "ShardedStateError",
    "SnapshotMismatchError",
    "SnapshotSettings",
    "SnapshotSpaceError",
    "Snapshots",
    "heartbeat",
    "list_checkpoints",
    "load_checkpoint",
    "load_checkpoint_from_any_rank",
    "save_checkpoint",
    "section",
]
