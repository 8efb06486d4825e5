"""What a snapshot says about itself, and the checks that a restore hands each rank its own.

Every snapshot (and every disk checkpoint written from one) records its ``Identity``: the step,
the global rank and world size that wrote it, and whether the state is *replicated* (the same on
every rank, as with DDP: any rank's copy serves every rank, at any world size) or *per-rank* (only
the rank that wrote it, at the same world size, may get it back) or *sharded* (DTensors: each rank
holds its shards with the metadata a resharding load needs; restored with a template, at any world
size, once the shards of every writer rank are found: ``shards.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .errors import SnapshotMismatchError

__all__ = ["Identity", "check_identity", "this_rank"]


@dataclass(frozen=True)
class Identity:
    step: int
    rank: int
    world_size: int
    replicated: bool
    sharded: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rank": self.rank, "world_size": self.world_size,
                "replicated": self.replicated, "sharded": self.sharded}

    @classmethod
    def from_dict(cls, d: Any) -> Identity:
        if not isinstance(d, Mapping):
            raise ValueError(f"no identity record ({type(d).__name__})")
        try:
            step, rank, world, rep = d["step"], d["rank"], d["world_size"], d["replicated"]
        except KeyError as err:
            raise ValueError(f"identity record without {err}") from None
        sharded = d.get("sharded", False)
        if not (all(type(v) is int for v in (step, rank, world)) and type(rep) is bool
                and type(sharded) is bool):
            raise ValueError(f"malformed identity record {dict(d)!r}")
        return cls(step, rank, world, rep, sharded)

    def describe(self) -> str:
        kind = "sharded" if self.sharded else "replicated" if self.replicated else "per-rank"
        return f"{kind} state of step {self.step} from rank {self.rank} of {self.world_size}"


def this_rank(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(global rank, world size): the process group's, else RANK/WORLD_SIZE, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def check_identity(found: Identity, step: int, rank: int, world: int, replicated: bool) -> None:
    """Raises ``SnapshotMismatchError`` unless ``found`` may be handed to ``rank`` of ``world``
    as the state of ``step``."""
    want = "replicated" if replicated else "per-rank"
    if found.sharded:
        raise SnapshotMismatchError(
            f"holds {found.describe()}: sharded state is restored with a template, "
            "restore(template=your_state_dict), which reshards it")
    if found.step != step:
        raise SnapshotMismatchError(f"holds {found.describe()}, not step {step}")
    if found.replicated != replicated:
        raise SnapshotMismatchError(
            f"holds {found.describe()}, but this Snapshots takes {want} state "
            f"(replicated={replicated}): use the setting the snapshot was taken with")
    if not replicated and (found.rank, found.world_size) != (rank, world):
        raise SnapshotMismatchError(
            f"holds {found.describe()}: rank {rank} of {world} may only get its own per-rank state")
