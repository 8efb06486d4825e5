"""Sharded state (DTensors, as ``fully_shard`` and ``get_state_dict`` give) in a snapshot, in
``torch.distributed.checkpoint`` (DCP) terms.

A rank's snapshot of sharded state is its DCP *local save plan* (one ``WriteItem`` per tensor
chunk it holds: the tensor's global shape and properties, this rank's chunk offsets and sizes;
one per plain object) and the data of each item: the local shard of each DTensor, plain tensors
and objects whole (every rank keeps these, so any rank can serve them). The identity (step, global
rank, world size, ``sharded``) is the snapshot's as for other state.

At restore the plans of one step, gathered from the ranks that hold them, become one DCP
``Metadata`` (``build_metadata``): checked (the same global shape and properties on every writer,
the chunks covering each tensor exactly) so that DCP's load planner reshards from them, never
from a mismatched set. ``restorable_step`` is the rule "which step can every rank restore": the
newest step for which the files of every writer rank of one world size are held by some rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (DefaultSavePlanner,
                                                          create_default_local_save_plan)
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from .errors import SnapshotMismatchError

__all__ = ["MARK", "Key", "build_metadata", "is_payload", "key_of", "restorable_step", "to_payload"]

MARK = "__elasticstore_sharded_snapshot__"  # the payload's marker key (format version as value)
Key = tuple[str, tuple[int, ...] | None]  # (flattened name, chunk offsets; None for an object)


def key_of(index: MetadataIndex) -> Key:
    return (index.fqn, None if index.offset is None else tuple(int(v) for v in index.offset))


def to_payload(state: Mapping[str, Any]) -> dict[str, Any]:
    """The snapshot payload of a state holding DTensors: this rank's write items and their data
    (local shards and plain tensors as tensors, copied into the snapshot; objects as they are).
    The items are DCP's local save plan, made again only when the state's layout changed
    (``_layout``): every step of a run has the same (about 0.1 ms per DTensor to plan)."""
    global _plan
    planner = DefaultSavePlanner()
    planner.set_up_planner(dict(state), None, True)
    flat = planner.state_dict  # flattened: "model.layer.weight" -> value
    layout = _layout(flat)
    if layout is not None and _plan is not None and _plan[0] == layout[0]:
        items = _plan[1]
    else:
        items = list(create_default_local_save_plan(flat, True).items)
        _plan = None if layout is None else (layout[0], items, layout[1])
    data: list[Any] = []
    for item in items:
        obj = flat[item.index.fqn]
        if item.type == WriteItemType.BYTE_IO:
            data.append(obj)
        elif isinstance(obj, DTensor):
            data.append(obj._local_tensor.detach())  # what the planner's lookup gives: its shard
        else:
            data.append(planner.lookup_object(item.index).detach())
    return {MARK: 1, "items": items, "data": data}


# The last plan made: (layout, items, the meshes it names, kept alive so that their ids stay theirs).
_plan: tuple[tuple[Any, ...], list[WriteItem], list[Any]] | None = None


def _layout(flat: Mapping[str, Any]) -> tuple[tuple[Any, ...], list[Any]] | None:
    """What DCP's local save plan of ``flat`` depends on, entry by entry: a DTensor's global shape,
    dtype, placements, mesh (this rank's coordinate in it) and local properties; a tensor's shape
    and properties; an object's name. None (plan every time) for any other kind of entry that
    plans itself."""
    parts: list[Any] = []
    meshes: list[Any] = []
    for fqn, v in flat.items():
        if isinstance(v, DTensor):
            local = v._local_tensor
            parts.append((fqn, 1, tuple(v.shape), v.dtype, tuple(v.placements), id(v.device_mesh),
                          local.dtype, local.layout, local.requires_grad, local.is_pinned()))
            meshes.append(v.device_mesh)
        elif hasattr(v, "__create_write_items__"):
            return None
        elif isinstance(v, torch.Tensor):
            parts.append((fqn, 2, tuple(v.shape), v.dtype, v.layout, v.requires_grad, v.is_pinned()))
        else:
            parts.append((fqn, 3))
    return tuple(parts), meshes


def is_payload(state: Any) -> bool:
    return isinstance(state, dict) and state.get(MARK) == 1


def restorable_step(holdings: Mapping[int, Mapping[int, int]],
                    not_after: int | None = None) -> int | None:
    """The newest step every rank can restore: ``holdings`` maps a step to the writer ranks whose
    snapshot of it some rank holds, each with the world size it was written at. A step counts
    when its writers are exactly ranks ``0 .. W-1`` of one world size ``W`` (a shard nobody holds,
    or files of two world sizes, and it does not). None when no step does."""
    for step in sorted(holdings, reverse=True):
        if not_after is not None and step > not_after:
            continue
        writers = holdings[step]
        worlds = set(writers.values())
        if len(worlds) == 1 and set(writers) == set(range(next(iter(worlds)))):
            return step
    return None


def build_metadata(step: int, plans: Mapping[int, Iterable[WriteItem]]) -> Metadata:
    """One DCP ``Metadata`` of ``step`` from every writer's items; ``SnapshotMismatchError`` when
    they disagree (a tensor's global shape or properties) or do not cover a tensor exactly."""
    md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    seen: dict[str, set[tuple[int, ...]]] = {}
    for writer in sorted(plans):
        for item in plans[writer]:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                if isinstance(md.get(fqn, BytesStorageMetadata()), TensorStorageMetadata):
                    raise SnapshotMismatchError(
                        f"step {step}: {fqn!r} is a tensor in one rank's snapshot and an object in "
                        f"rank {writer}'s")
                md[fqn] = BytesStorageMetadata()
                continue
            td = item.tensor_data
            assert td is not None
            have = md.get(fqn)
            if have is None:
                have = md[fqn] = TensorStorageMetadata(td.properties, td.size, [])
                seen[fqn] = set()
            if not isinstance(have, TensorStorageMetadata) or have.size != td.size \
                    or have.properties.dtype != td.properties.dtype:
                raise SnapshotMismatchError(
                    f"step {step}: the snapshots disagree on {fqn!r} (rank {writer} has "
                    f"{tuple(td.size)} {td.properties.dtype}): they are not of one run's state; "
                    "remove the snapshot directory's files or resume from a disk checkpoint")
            offsets = tuple(int(v) for v in td.chunk.offsets)
            if offsets not in seen[fqn]:
                seen[fqn].add(offsets)
                have.chunks.append(ChunkStorageMetadata(td.chunk.offsets, td.chunk.sizes))
    for fqn, tmd in md.items():
        if isinstance(tmd, TensorStorageMetadata):
            covered = sum(math.prod(c.sizes) for c in tmd.chunks)
            if covered != math.prod(tmd.size):
                raise SnapshotMismatchError(
                    f"step {step}: the chunks of {fqn!r} cover {covered} of its "
                    f"{math.prod(tmd.size)} elements: a shard is missing or two overlap")
    return Metadata(state_dict_metadata=md)
