"""Where a worker's snapshots go (``SnapshotSettings``), read once from its environment."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["SNAPSHOT_DIR_ENV", "SnapshotSettings"]

SNAPSHOT_DIR_ENV = "ELASTICSTORE_SNAPSHOT_DIR"


@dataclass(frozen=True)
class SnapshotSettings:
    """Where snapshots go: the agent's directory (None: the process's own memory) and the local
    rank whose files this process writes."""

    directory: str | None
    local_rank: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SnapshotSettings:
        env = os.environ if env is None else env
        directory = env.get(SNAPSHOT_DIR_ENV) or None
        if directory is not None and not os.path.isdir(directory):
            warnings.warn(f"{SNAPSHOT_DIR_ENV}={directory} is not a directory: snapshots stay in "
                          "this process's memory", RuntimeWarning, stacklevel=3)
            directory = None
        try:
            local_rank = int(env.get("LOCAL_RANK", "0"))
        except ValueError as err:
            raise ValueError(f"LOCAL_RANK={env.get('LOCAL_RANK')!r} is not an integer") from err
        return cls(directory, local_rank)
