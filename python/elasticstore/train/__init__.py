"""What a training script touches: an elastic sampler, in-memory snapshots and atomic checkpoints.

``ElasticDistributedSampler`` orders each epoch the same at every world size, so a job that
resumes at another size (``state_dict``/``load_state_dict``) sees every sample once.
``save_checkpoint``/``load_checkpoint`` write and read checkpoints atomically;
``load_checkpoint_from_any_rank`` resumes from node-local directories. ``Snapshots`` copies the
state every step into the agent's shared memory and writes the disk checkpoints from it in the
background; its ``restore`` resumes from the newest step any node holds. ``heartbeat()`` (once
per step) and ``section()`` let the agent tell a hang from a long step. Nothing here imports the
agent or the rendezvous: it runs unchanged under ``torchrun``. See ``docs/training.md``.

The names load on first use: the agent reads ``heartbeat_layout`` (and the replica service parts
of ``snapshots``) without paying for ``torch.distributed.checkpoint``, which the snapshots' disk
writer imports (about 1 s).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

if TYPE_CHECKING:
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

# Each public name and the submodule that defines it.
_SOURCES = {
    "Checkpoint": ".checkpoint",
    "CheckpointConflictError": ".checkpoint",
    "list_checkpoints": ".checkpoint",
    "load_checkpoint": ".checkpoint",
    "load_checkpoint_from_any_rank": ".checkpoint",
    "save_checkpoint": ".checkpoint",
    "heartbeat": ".heartbeats",
    "section": ".heartbeats",
    "ElasticDistributedSampler": ".sampler",
    "ShardedStateError": ".sharded",
    "KEEP_PER_RANK": ".snapshots",
    "Restored": ".snapshots",
    "SnapshotMismatchError": ".snapshots",
    "SnapshotSettings": ".snapshots",
    "SnapshotSpaceError": ".snapshots",
    "Snapshots": ".snapshots",
}

__all__ = sorted(_SOURCES, key=str.lower)

__getattr__, __dir__ = lazy_names(__name__, _SOURCES, globals())
