"""``Snapshots.restore(template=...)`` for sharded state: a collective that loads the newest step
every rank can get INTO the template, resharded to this world size and layout by DCP's load.

1. Each rank reads its node's sharded snapshots (mapped, not copied; its own and those of other
   nodes placed in the area's ``replicas/``: a file's identity names its writer) and lists the complete DCP
   checkpoints of the checkpoint directory; one ``all_gather_object`` shares what each holds
   (step, writer rank, world size, write items).
2. ``shards.restorable_step``: the newest step whose every writer rank's snapshot is held by some
   rank; the newest disk checkpoint every rank lists competes with it (the newer wins; memory on a
   tie). A step some shard of which nobody holds is never taken.
3. ``shards.build_metadata`` checks the writers' items agree and cover every tensor; the template
   is checked against it (names, global shapes: ``SnapshotMismatchError`` saying what differs).
4. Each rank plans its reads (DCP's default load plan); items it lacks on its node are asked of a
   rank that holds them (one ``all_gather_object`` of the requests, then each holder sends each
   rank what it asked, point to point: ``exchange.py``). ``dcp.load`` with
   ``reader.SnapshotReader`` then copies into the template.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner,
                                                          create_default_local_load_plan)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .errors import SnapshotMismatchError
from .exchange import exchange
from .fileformat import list_snapshots, read_snapshot
from .identity import Identity, this_rank
from .reader import SnapshotReader
from .restore import Restored
from .shards import Key, build_metadata, is_payload, key_of, restorable_step

__all__ = ["DCP_NAME", "REPLICAS", "list_dcp", "restore_sharded"]

REPLICAS = "replicas"  # other nodes' snapshot files placed in this node's area (same names)
DCP_NAME = re.compile(r"^dcp-step-(\d{12,})$")


def list_dcp(directory: str | None) -> list[tuple[int, str]]:
    """The complete DCP checkpoints (``dcp-step-<step>`` with a ``.metadata``) of ``directory``."""
    if directory is None:
        return []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(directory, n)) for n in names
             if (m := DCP_NAME.match(n)) and os.path.exists(os.path.join(directory, n, ".metadata"))]
    return sorted(found)


def _gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _read_area(directory: str | None) -> dict[tuple[int, int], tuple[int, list[Any], list[Any]]]:
    """(step, writer rank) -> (world size, write items, data) of this node's sharded snapshots."""
    found: dict[tuple[int, int], tuple[int, list[Any], list[Any]]] = {}
    files = [] if directory is None else \
        list_snapshots(directory) + list_snapshots(os.path.join(directory, REPLICAS))
    for step, _, path in files:
        try:
            got, ident_d, state = read_snapshot(path, clone=False)
            ident = Identity.from_dict(ident_d)
            if got != step or ident.step != step:
                raise ValueError(f"holds step {got}, its name says {step}")
        except (OSError, ValueError, EOFError, RuntimeError) as err:
            warnings.warn(f"skipping snapshot {path}: {type(err).__name__}: {err}",
                          RuntimeWarning, stacklevel=3)
            continue
        if not ident.sharded or not is_payload(state):
            continue  # not sharded state: restore() without a template reads it
        found[(step, ident.rank)] = (ident.world_size, state["items"], state["data"])
    return found


def _check_template(flat: Mapping[str, Any], metadata: Metadata, step: int) -> None:
    missing = sorted(k for k in flat if k not in metadata.state_dict_metadata)
    if missing:
        raise SnapshotMismatchError(
            f"the snapshot of step {step} has no {missing[:5]} of the template (it holds "
            f"{sorted(metadata.state_dict_metadata)[:5]}...): pass the same state dict as to "
            "snapshot() (same keys)")
    for fqn, obj in flat.items():
        md = metadata.state_dict_metadata[fqn]
        size = getattr(obj, "size", None)
        if isinstance(md, TensorStorageMetadata) and callable(size) and tuple(size()) != tuple(md.size):
            raise SnapshotMismatchError(
                f"{fqn!r}: the snapshot of step {step} holds a tensor of global shape "
                f"{tuple(md.size)}, the template {tuple(size())}: not this model's state")


def restore_sharded(directory: str | None, checkpoint_dir: str | None, template: dict[str, Any],
                    group: dist.ProcessGroup | None) -> Restored | None:
    rank, world = this_rank(group)
    area = _read_area(directory)
    mine = {k: (v[0], v[1]) for k, v in area.items()}
    disk = [s for s, _ in list_dcp(checkpoint_dir)]
    views = _gather((mine, disk), group)
    holders: dict[tuple[int, int], list[int]] = {}
    plans: dict[tuple[int, int], list[Any]] = {}
    holdings: dict[int, dict[int, int]] = {}
    for r, (held, _) in enumerate(views):
        for (step, writer), (w_world, witems) in held.items():
            holders.setdefault((step, writer), []).append(r)
            plans.setdefault((step, writer), witems)
            holdings.setdefault(step, {})[writer] = w_world
    common = set(views[0][1]).intersection(*(set(v[1]) for v in views[1:]))
    top_disk = max(common) if common else None
    step = restorable_step(holdings)
    if step is None or (top_disk is not None and top_disk > step):
        if top_disk is None:
            return None
        assert checkpoint_dir is not None
        path = dict(list_dcp(checkpoint_dir))[top_disk]
        dcp.load(template, checkpoint_id=path, process_group=group)
        return Restored(top_disk, template, "disk", path)
    writers = sorted(holdings[step])
    w_world = holdings[step][writers[0]]
    metadata = build_metadata(step, {w: plans[(step, w)] for w in writers})
    flat, _ = flatten_state_dict(template)
    _check_template(flat, metadata, step)
    have: dict[Key, list[int]] = {}  # key -> writers holding it
    for w in writers:
        for item in plans[(step, w)]:
            have.setdefault(key_of(item.index), []).append(w)
    local = {w for w in writers if (step, w) in area}
    sources: dict[Key, int] = {}
    for key, ws in have.items():
        if w_world == world and rank in ws and rank in local:
            sources[key] = rank
        else:
            near = [w for w in ws if w in local]
            sources[key] = min(near) if near else min(ws)
    needed = {key_of(r.storage_index) for r in create_default_local_load_plan(flat, metadata).items}
    asks = sorted((holders[(step, sources[k])][0], sources[k], k) for k in needed
                  if sources[k] not in local)
    items: dict[tuple[int, Key], Any] = {}
    for w in local:
        _, its, data = area[(step, w)]
        for item, value in zip(its, data):
            items[(w, key_of(item.index))] = value
    all_asks = _gather(asks, group)
    if any(all_asks):
        items.update(exchange(all_asks, items, rank, group))
    reader = SnapshotReader(metadata, items, sources)
    dcp.load(template, storage_reader=reader, planner=DefaultLoadPlanner(), process_group=group)
    source = "peer" if asks else "memory"
    detail = directory or "" if not asks else f"ranks {sorted({h for h, _, _ in asks})}"
    return Restored(step, template, source, detail)
