"""The items a sharded restore moves between ranks (``sharded_restore.py``, step 4), point to
point: each holder sends each rank what that rank asked of it, and nothing to anyone else.

Every rank knows every rank's requests (one ``all_gather_object`` of them, small: names and
offsets), so both ends of each pair know what crosses it. The pairs that carry something are
taken in one global order (by their lower rank, then their higher): a rank waits only on the
first pair not yet done, which both of its ranks reach, so no two ranks wait on each other.
Within a pair the lower rank sends first. Each message is one ``send_object_list`` of the items
asked: tensors cloned first, so that a chunk read from a mapped snapshot file is sent alone, not
with the whole file it views.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .errors import SnapshotMismatchError
from .shards import Key

__all__ = ["Ask", "exchange"]

Ask = tuple[int, int, Key]  # (the rank asked, the writer rank of the item, the item's key)


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def exchange(all_asks: Sequence[Sequence[Ask]], items: Mapping[tuple[int, Key], Any],
             rank: int, group: dist.ProcessGroup | None) -> dict[tuple[int, Key], Any]:
    """What the other ranks sent this rank (``rank``, in ``group``): ``all_asks[r]`` is what rank
    ``r`` asks, ``items`` what this rank holds, by (writer rank, key)."""
    outgoing: dict[int, list[tuple[int, Key]]] = {}
    incoming: dict[int, list[tuple[int, Key]]] = {}
    pairs: set[tuple[int, int]] = set()
    for dst, wanted in enumerate(all_asks):
        for holder, writer, key in wanted:
            if holder == dst:
                raise SnapshotMismatchError(f"rank {dst} asks itself for {key!r}")
            pairs.add((min(holder, dst), max(holder, dst)))
            if holder == rank:
                outgoing.setdefault(dst, []).append((writer, key))
            if dst == rank:
                incoming.setdefault(holder, []).append((writer, key))
    received: dict[tuple[int, Key], Any] = {}
    for low, high in sorted(pairs):
        if rank not in (low, high):
            continue
        peer = high if rank == low else low
        for sending in ((True, False) if rank == low else (False, True)):
            if sending and peer in outgoing:
                payload = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                           for k in outgoing[peer] for v in (items[k],)}
                dist.send_object_list([payload], dst=_global(group, peer), group=group)
            elif not sending and peer in incoming:
                box: list[Any] = [None]
                dist.recv_object_list(box, src=_global(group, peer), group=group)
                got = box[0]
                if not isinstance(got, dict) or set(got) != set(incoming[peer]):
                    raise SnapshotMismatchError(
                        f"rank {peer} sent {len(got) if isinstance(got, dict) else got!r} items "
                        f"where {len(incoming[peer])} were asked of it")
                received.update(got)
    return received
