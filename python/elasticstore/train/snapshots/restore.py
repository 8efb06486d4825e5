"""``Snapshots.restore``: the newest step that every rank of the new round can get, and only state
that is the rank's own.

1. Each rank lists its node's snapshots and its local checkpoint directory; one all_reduce (MAX)
   gives the newest snapshot step ``M`` and the newest checkpoint step ``D`` of the whole group.
2. ``D > M`` (or no snapshot anywhere): ``load_checkpoint_from_any_rank`` (disk).
3. Else each rank whose node holds ``M`` reads it from memory: its own local rank's file first;
   another local rank's only for replicated state. Every file's identity is checked
   (``identity.check_identity``: step, replicated or per-rank, and for per-rank state the rank and
   world size); one that is not this rank's is skipped with a warning. One all_reduce (MIN) names
   the lowest rank that read it and the lowest rank that lacks it. Per-rank state cannot come
   from another rank: when any rank lacks its own, every rank raises ``SnapshotMismatchError``.
   For replicated state the reader broadcasts it (``broadcast_object_list``); when no rank could
   read ``M`` after all, disk again.
Sharded state (the newest step's snapshots hold DTensors) is restored with a template
(``sharded_restore.py``): here every rank raises ``SnapshotMismatchError`` saying so.
4. A disk checkpoint is checked too: one written from a snapshot carries its identity and must be
   replicated state; none may hold sharded tensors.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint import (Checkpoint, list_checkpoints, load_checkpoint,
                          load_checkpoint_from_any_rank)
from .fileformat import list_snapshots, read_snapshot
from ..sharded import sharded_path
from .errors import SnapshotMismatchError
from .identity import Identity, check_identity, this_rank

__all__ = ["Restored", "newest", "read_local", "restore"]


@dataclass(frozen=True)
class Restored:
    """What ``Snapshots.restore`` found: the step, the state given to ``snapshot`` (tensors on
    the CPU), and where it came from: ``"memory"`` (this node's), ``"peer"`` (another rank's
    memory, sent by ``detail``: ``rank N``) or ``"disk"`` (``detail``: the checkpoint file)."""

    step: int
    state: Any
    source: str
    detail: str


def newest(values: list[int], group: dist.ProcessGroup | None, op: Any) -> list[int]:
    """``values`` reduced over ``group`` with ``op`` (as they are without a process group)."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=op, group=group)
    return [int(v) for v in t.tolist()]


def read_local(candidates: list[tuple[int, int, str]], step: int, local_rank: int, rank: int,
               world: int, replicated: bool) -> tuple[Any, str] | None:
    """The state of ``step`` from this node's snapshots that ``rank`` of ``world`` may get: this
    local rank's file, then (replicated state only) the others'; None when none reads and fits."""
    paths = sorted((lr != local_rank, p) for s, lr, p in candidates
                   if s == step and (lr == local_rank or replicated))
    for _, path in paths:
        try:
            got, ident, state = read_snapshot(path)
            if got != step:
                raise ValueError(f"holds step {got}, its name says {step}")
            check_identity(Identity.from_dict(ident), step, rank, world, replicated)
        except (OSError, ValueError, EOFError, RuntimeError) as err:
            warnings.warn(f"skipping snapshot {path}: {type(err).__name__}: {err}",
                          RuntimeWarning, stacklevel=3)
            continue
        return state, path
    return None


def restore(directory: str | None, local_rank: int, checkpoint_dir: str | None,
            replicated: bool, group: dist.ProcessGroup | None) -> Restored | None:
    mem = list_snapshots(directory) if directory is not None else []
    disk = list_checkpoints(checkpoint_dir) if checkpoint_dir else []
    own_mem = mem[-1][0] if mem else -1
    own_sharded = _newest_sharded(mem, own_mem)
    top_mem, top_disk, top_sharded = newest([own_mem, disk[-1][0] if disk else -1, own_sharded],
                                            group, dist.ReduceOp.MAX)
    if top_mem < 0 and top_disk < 0:
        return None
    if top_sharded >= 0 and top_sharded == top_mem and top_mem >= top_disk:
        raise SnapshotMismatchError(
            f"the newest snapshot (step {top_mem}) holds sharded state (DTensors): restore it with "
            "a template, snaps.restore(template=your_state_dict) (e.g. {'model': msd, 'optim': "
            "osd} from get_state_dict), which loads it into the template, resharded")
    if top_disk > top_mem:
        return _disk(checkpoint_dir, group)
    rank, world = this_rank(group)
    local = read_local(mem, top_mem, local_rank, rank, world, replicated)
    if not dist.is_initialized():
        if local is None:
            return _disk(checkpoint_dir, group)
        return Restored(top_mem, local[0], "memory", local[1])
    src, lacking = newest([rank if local is not None else world,
                           world if local is not None else rank], group, dist.ReduceOp.MIN)
    if not replicated and lacking < world:
        raise SnapshotMismatchError(
            f"rank {lacking} of {world} has no snapshot of its own for step {top_mem} (per-rank "
            "state: another rank's cannot stand in for it; the node that held it is gone, or the "
            "world size changed). Resume per-rank state from your own per-rank checkpoints "
            "(torch.distributed.checkpoint), or remove it from the snapshot")
    if src == world:  # listed, but nobody could read it
        return _disk(checkpoint_dir, group)
    if lacking == world:
        assert local is not None
        return Restored(top_mem, local[0], "memory", local[1])
    payload: list[Any] = [None]
    if rank == src and local is not None:
        payload = [(Identity(top_mem, rank, world, True).to_dict(), local[0])]
    global_src = src if group is None else dist.get_global_rank(group, src)
    dist.broadcast_object_list(payload, src=global_src, group=group)
    if local is not None:
        return Restored(top_mem, local[0], "memory", local[1])
    ident, state = payload[0]
    check_identity(Identity.from_dict(ident), top_mem, rank, world, replicated)
    return Restored(top_mem, state, "peer", f"rank {src}")


def _newest_sharded(mem: list[tuple[int, int, str]], step: int) -> int:
    """``step`` when a snapshot of it on this node holds sharded state, else -1."""
    for s, _, path in mem:
        if s == step:
            try:
                ident = Identity.from_dict(read_snapshot(path, clone=False)[1])
            except (OSError, ValueError, EOFError, RuntimeError):
                continue
            if ident.sharded:
                return step
    return -1


def _disk(checkpoint_dir: str | None, group: dist.ProcessGroup | None) -> Restored | None:
    if checkpoint_dir is None:
        return None
    ckpt: Checkpoint | None
    if dist.is_initialized():
        ckpt = load_checkpoint_from_any_rank(checkpoint_dir, group)
    else:
        ckpt = load_checkpoint(checkpoint_dir)
    if ckpt is None:
        return None
    if ckpt.meta is not None:
        found = Identity.from_dict(ckpt.meta)
        try:
            check_identity(found, ckpt.step, found.rank, found.world_size, True)
        except SnapshotMismatchError as err:
            raise SnapshotMismatchError(f"the disk checkpoint {ckpt.path} {err}") from None
    where = sharded_path(ckpt.state)
    if where is not None:
        raise SnapshotMismatchError(
            f"the disk checkpoint {ckpt.path} holds a sharded tensor at {where!r}: one rank's "
            "shard cannot be handed to every rank. Use torch.distributed.checkpoint for sharded "
            "state")
    return Restored(ckpt.step, ckpt.state, "disk", ckpt.path)
