"""The items a sharded restore moves between ranks (``train/snapshots/exchange.py``): 3 real gloo
ranks (forked, a FileStore), each holding chunks that view one large mapped-like buffer, as a
snapshot read from its file does. Each rank receives exactly what it asked, from the rank it
asked, and each chunk arrives alone: its storage is the chunk's bytes, not the whole buffer it
viewed at the sender (sent whole, every asked chunk of a 4 MB buffer would carry the 4 MB)."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elasticstore.train.snapshots.exchange import exchange

WORLD = 3
BASE = 1 << 20  # float32 elements of each rank's buffer (4 MB)
CHUNK = 1000


def _rank(rank: int, store_path: str, out: Any) -> None:
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank,
                                world_size=WORLD)
        base = torch.full((BASE,), float(rank))
        items = {(rank, ("w", (rank * CHUNK,))): base[:CHUNK], (rank, ("note", None)): f"r{rank}"}
        # rank 0 asks rank 1 for its chunk and note, rank 1 asks rank 2 for its chunk; rank 2
        # asks nothing
        all_asks = [[(1, 1, ("w", (CHUNK,))), (1, 1, ("note", None))],
                    [(2, 2, ("w", (2 * CHUNK,)))], []]
        got = exchange(all_asks, items, rank, None)
        out.put((rank, {k: (v.untyped_storage().nbytes(), float(v.sum()))
                        if isinstance(v, torch.Tensor) else v for k, v in got.items()}))
        dist.destroy_process_group()
    except BaseException as err:  # the test reports it
        out.put((rank, repr(err)))


@pytest.mark.timeout(120)
def test_each_rank_gets_what_it_asked_and_chunks_travel_alone(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), out), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=90) for _ in range(WORLD))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                os.kill(p.pid, 9)
                p.join()
    chunk_bytes = CHUNK * 4
    assert results[0] == {(1, ("w", (CHUNK,))): (chunk_bytes, float(CHUNK)),
                          (1, ("note", None)): "r1"}, results
    assert results[1] == {(2, ("w", (2 * CHUNK,))): (chunk_bytes, float(2 * CHUNK))}, results
    assert results[2] == {}, results
