"""In-memory snapshots of the training state (``Snapshots``); see ``writer.py``.

``fileformat.py`` the bytes of one snapshot and the mapped memory holding them; ``identity.py``
whose state a snapshot holds (step, rank, world size, replicated or per-rank); ``writer.py`` taking
snapshots (``Snapshots``); ``disk.py`` the background disk checkpoints; ``restore.py`` the newest
step every rank can get, and only its own; ``errors.py`` what they raise.

The names load on first use: the replica service reads ``hold`` and ``peek`` without importing
the writer, whose disk checkpoints import ``torch.distributed.checkpoint`` (about 1 s).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_names

if TYPE_CHECKING:
    from .errors import ShardedStateError, SnapshotMismatchError, SnapshotSpaceError
    from .restore import Restored
    from .settings import SNAPSHOT_DIR_ENV, SnapshotSettings
    from .writer import KEEP_PER_RANK, Snapshots

# Each public name and the submodule that defines it.
_SOURCES = {
    "ShardedStateError": ".errors",
    "SnapshotMismatchError": ".errors",
    "SnapshotSpaceError": ".errors",
    "Restored": ".restore",
    "KEEP_PER_RANK": ".writer",
    "SNAPSHOT_DIR_ENV": ".settings",
    "SnapshotSettings": ".settings",
    "Snapshots": ".writer",
}

__all__ = sorted(_SOURCES)

__getattr__, __dir__ = lazy_names(__name__, _SOURCES, globals())
