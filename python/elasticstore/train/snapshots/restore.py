"""``Snapshots.restore``: the newest step that every rank of the new round can get.

1. Each rank lists its node's snapshots and its local checkpoint directory; one all_reduce (MAX)
   gives the newest snapshot step ``M`` and the newest checkpoint step ``D`` of the whole group.
2. ``D > M`` (or no snapshot anywhere): ``load_checkpoint_from_any_rank`` (disk).
3. Else each rank whose node holds ``M`` reads it from memory; one all_reduce (MIN) names the
   lowest rank that read it and says whether any rank lacks it; only then, that rank broadcasts
   it (``broadcast_object_list``). When no rank could read ``M`` after all, disk again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from .snapshot import Restored, _checkpoint_load, newest, read_local

if TYPE_CHECKING:
    from .snapshot import Snapshots

__all__ = ["restore"]


def restore(snaps: Snapshots, group: dist.ProcessGroup | None) -> Restored | None:
    mem, disk_step = snaps.local_candidates()
    own_mem = mem[-1][0] if mem else -1
    top_mem, top_disk = newest([own_mem, disk_step], group, dist.ReduceOp.MAX)
    if top_mem < 0 and top_disk < 0:
        return None
    if top_disk > top_mem:
        return _disk(snaps, group)
    local = read_local(mem, top_mem, snaps.settings.local_rank) if own_mem == top_mem else None
    if not dist.is_initialized():
        if local is None:
            return _disk(snaps, group)
        return Restored(top_mem, local[0], "memory", local[1])
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    src, lacking = newest([rank if local is not None else world, -int(local is None)], group,
                          dist.ReduceOp.MIN)
    if src == world:  # listed, but nobody could read it
        return _disk(snaps, group)
    if lacking == 0:
        assert local is not None
        return Restored(top_mem, local[0], "memory", local[1])
    payload: list[Any] = [local[0] if rank == src and local is not None else None]
    global_src = src if group is None else dist.get_global_rank(group, src)
    dist.broadcast_object_list(payload, src=global_src, group=group)
    if local is not None:
        return Restored(top_mem, local[0], "memory", local[1])
    return Restored(top_mem, payload[0], "peer", f"rank {src}")


def _disk(snaps: Snapshots, group: dist.ProcessGroup | None) -> Restored | None:
    if snaps.checkpoint_dir is None:
        return None
    if not dist.is_initialized():
        from .checkpoint import load_checkpoint

        ckpt = load_checkpoint(snaps.checkpoint_dir)
        return None if ckpt is None else Restored(ckpt.step, ckpt.state, "disk", ckpt.path)
    return _checkpoint_load(snaps.checkpoint_dir, group)
