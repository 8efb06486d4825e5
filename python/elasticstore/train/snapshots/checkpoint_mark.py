"""Where a worker's disk checkpoints go, recorded in the node's snapshot area for the agent: at
its first snapshot, a ``Snapshots`` with a ``checkpoint_dir`` writes ``.checkpoint.local-<local
rank>`` (JSON: the directory, how many to keep, whether this rank writes the replicated
checkpoints). ``flush.py`` reads them when the job is signalled to stop."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass

__all__ = ["MARK", "Mark", "mark", "marks"]

MARK = ".checkpoint.local-"  # + local rank


@dataclass(frozen=True)
class Mark:
    """Where a local rank's disk checkpoints go."""

    directory: str
    keep: int
    write: bool  # this rank writes the replicated checkpoints (sharded: every rank writes)


def mark(area: str, local_rank: int, directory: str, keep: int, write: bool) -> None:
    """Records (atomically) where ``local_rank``'s checkpoints go, in the snapshot area."""
    path = os.path.join(area, f"{MARK}{local_rank}")
    tmp = f"{path}.{uuid.uuid4().hex}"
    with open(tmp, "w") as f:
        json.dump({"directory": os.path.abspath(directory), "keep": keep, "write": write}, f)
    os.replace(tmp, path)


def marks(area: str) -> dict[int, Mark]:
    """Local rank -> its ``Mark`` (unreadable ones left out)."""
    found: dict[int, Mark] = {}
    for name in os.listdir(area):
        if not name.startswith(MARK) or not name[len(MARK):].isdigit():
            continue
        try:
            with open(os.path.join(area, name)) as f:
                d = json.load(f)
            found[int(name[len(MARK):])] = Mark(str(d["directory"]), int(d["keep"]), bool(d["write"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found
