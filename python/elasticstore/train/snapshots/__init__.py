"""In-memory snapshots of the training state (``Snapshots``); see ``writer.py``.

``fileformat.py`` the bytes of one snapshot and the mapped memory holding them; ``identity.py``
whose state a snapshot holds (step, rank, world size, replicated or per-rank); ``writer.py`` taking
snapshots (``Snapshots``); ``disk.py`` the background disk checkpoints; ``restore.py`` the newest
step every rank can get, and only its own; ``errors.py`` what they raise.
"""

from __future__ import annotations

from .errors import ShardedStateError, SnapshotMismatchError, SnapshotSpaceError
from .restore import Restored
from .writer import KEEP_PER_RANK, SNAPSHOT_DIR_ENV, SnapshotSettings, Snapshots

__all__ = ["KEEP_PER_RANK", "SNAPSHOT_DIR_ENV", "Restored", "ShardedStateError",
           "SnapshotMismatchError", "SnapshotSettings", "SnapshotSpaceError", "Snapshots"]
