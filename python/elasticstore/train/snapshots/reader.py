"""A DCP ``StorageReader`` over sharded snapshots: the files this rank reached (its node's memory)
and the items other ranks sent it, presented to ``dcp.load`` as one checkpoint of one step, so that
DCP's load planner reshards them into the template.

Each rank has its own view (``sources``): for every stored item (a chunk of a tensor, a plain
tensor, an object) the writer rank whose copy it reads. Duplicates (plain tensors and objects, kept
by every writer) are read from this rank's own snapshot when it took one at the same world size,
else from the lowest writer it reached.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .shards import Key, key_of

__all__ = ["SnapshotReader"]


class SnapshotReader(StorageReader):
    """``metadata``: the step's (``shards.build_metadata``); ``items``: (writer rank, key) -> the
    data this rank holds (its node's files, and what peers sent)."""

    def __init__(self, metadata: Metadata, items: Mapping[tuple[int, Key], Any],
                 sources: Mapping[Key, int]) -> None:
        super().__init__()
        self.metadata, self.items, self.sources = metadata, items, sources

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def data(self, index: MetadataIndex) -> Any:
        key = key_of(index)
        return self.items[(self.sources[key], key)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for req in plan.items:
            stored = self.data(req.storage_index)
            if req.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(stored, buf)
                buf.seek(0)
                planner.load_bytes(req, buf)
                continue
            src = stored
            for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                src = src.narrow(dim, int(start), int(length))
            target = planner.resolve_tensor(req).detach()
            if target.size() != src.size():
                raise ValueError(f"{req.storage_index.fqn}: a chunk of {tuple(src.size())} read "
                                 f"into {tuple(target.size())}")
            target.copy_(src)
            planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
