"""The disk checkpoint of sharded state: a DCP checkpoint in which every rank writes its own shard,
without a collective (it is written by each rank's background thread, from its snapshot).

Each rank writes its data file (``__<rank>_0.distcp``, by DCP's ``FileSystemWriter``) and then a
record of what it wrote (``.part-<rank>``, atomically) into ``.dcp-step-<step>.tmp``; the rank
that finds every part of the step's world size there, and is the first to create ``.completing``
in it (two ranks may find every part at once), writes DCP's ``.metadata`` and renames the
directory to ``dcp-step-<step>``. A checkpoint is complete only under that name: ``dcp.load`` (or
``Snapshots.restore(template=...)``) reads it at any world size. The newest ``keep`` are kept; a
step some rank skipped (its disk writer lagged) never completes and is removed once a newer one
has.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
import shutil
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StoragePrefix
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from .shards import build_metadata, key_of

__all__ = ["write_shard"]

log = logging.getLogger("elasticstore.train.snapshots")
_TMP = re.compile(r"^\.dcp-step-(\d{12,})\.tmp$")
_CLAIM = ".completing"  # created (O_EXCL) by the one rank that completes a step


class _Planner(SavePlanner):
    """Resolves a snapshot payload's items for ``FileSystemWriter.write_data``."""

    def __init__(self, items: list[WriteItem], data: list[Any]) -> None:
        self.by_key = {key_of(i.index): d for i, d in zip(items, data)}

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        raise NotImplementedError

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        raise NotImplementedError

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        value = self.by_key[key_of(write_item.index)]
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(value, buf)
            return buf
        return value  # type: ignore[no-any-return]


def _dump(path: str, obj: Any) -> None:
    tmp = f"{path}.{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        pickle.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(directory: str, step: int, rank: int, world: int, items: list[WriteItem],
                data: list[Any], keep: int) -> str | None:
    """Writes ``rank``'s shard of ``step``; completes the checkpoint when it is the last part.
    Returns the complete checkpoint's path when this call completed it. A step whose directory
    was removed meanwhile (a newer checkpoint completed: this rank lagged) is given up."""
    try:
        return _write_shard(directory, step, rank, world, items, data, keep)
    except OSError:
        if os.path.exists(os.path.join(directory, f"dcp-step-{step:012d}")):
            return None  # another rank completed it meanwhile
        newer = [n for n in os.listdir(directory)
                 if re.fullmatch(r"dcp-step-\d{12,}", n) and int(n.split("-")[-1]) > step]
        if newer:
            log.warning("disk checkpoint of step %d given up: a newer one (%s) completed while "
                        "rank %d wrote it", step, max(newer), rank)
            return None
        raise


def _write_shard(directory: str, step: int, rank: int, world: int, items: list[WriteItem],
                 data: list[Any], keep: int) -> str | None:
    final = os.path.join(directory, f"dcp-step-{step:012d}")
    tmp = os.path.join(directory, f".dcp-step-{step:012d}.tmp")
    if os.path.exists(final):
        return None
    os.makedirs(tmp, exist_ok=True)
    writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True)
    writer.set_up_storage_writer(rank == 0)
    plan = writer.prepare_local_plan(SavePlan(items, storage_data=_StoragePrefix(f"__{rank}_")))
    results = writer.write_data(plan, _Planner(items, data)).wait()
    _dump(os.path.join(tmp, f".part-{rank}"), (world, items, results))
    parts = [n for n in os.listdir(tmp) if re.fullmatch(r"\.part-\d+", n)]
    if len(parts) < world:
        return None
    loaded: dict[int, tuple[int, list[WriteItem], list[Any]]] = {}
    for name in parts:
        with open(os.path.join(tmp, name), "rb") as f:
            loaded[int(name.split("-")[1])] = pickle.load(f)
    if set(loaded) != set(range(world)) or any(v[0] != world for v in loaded.values()):
        return None
    try:  # one rank completes the step: two may find every part at once
        os.close(os.open(os.path.join(tmp, _CLAIM), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return None
    metadata = build_metadata(step, {r: v[1] for r, v in loaded.items()})
    # duplicates (plain tensors, objects): rank 0's copy is named last, so it is the one read
    writer.finish(metadata, [loaded[r][2] for r in sorted(loaded, reverse=True)])
    try:
        os.rename(tmp, final)
    except OSError:
        return None  # another rank completed it
    _prune(directory, keep)
    return final


def _prune(directory: str, keep: int) -> None:
    done = sorted(n for n in os.listdir(directory) if re.fullmatch(r"dcp-step-\d{12,}", n))
    for name in done[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    newest = int(done[-1].split("-")[-1]) if done else -1
    for name in os.listdir(directory):
        m = _TMP.match(name)
        if m and int(m.group(1)) < newest:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
