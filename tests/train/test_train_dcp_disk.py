"""The disk checkpoint of sharded state (``train/snapshots/dcp_disk.py``): every rank writes its
own shard from its background thread, with no collective, and the rank that finds every part
completes the step. Two ranks that both find every part at once (their parts landed together)
must not both complete it: one does, the other leaves it, and neither fails. Before, both wrote
DCP's ``.metadata.tmp`` and the second rename failed; the rank stopped with "the background disk
checkpoint failed" (seen under a goodput run)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from elasticstore.train.snapshots.dcp_disk import write_shard
from elasticstore.train.snapshots.shards import to_payload

STEPS = 30


def test_two_ranks_completing_a_step_at_once_never_fail(tmp_path: Path) -> None:
    directory = str(tmp_path)
    payloads = {rank: to_payload({"w": torch.full((1000,), float(rank)), "step": rank})
                for rank in (0, 1)}
    errors: list[BaseException] = []
    completed: dict[int, list[int]] = {0: [], 1: []}

    def write(rank: int, step: int, start: threading.Barrier) -> None:
        p = payloads[rank]
        start.wait(10)
        try:
            if write_shard(directory, step, rank, 2, p["items"], p["data"], keep=STEPS) is not None:
                completed[rank].append(step)
        except BaseException as err:  # noqa: BLE001  (reported below)
            errors.append(err)

    for step in range(1, STEPS + 1):
        start = threading.Barrier(2)
        threads = [threading.Thread(target=write, args=(r, step, start)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, f"step {step}: {errors[0]!r}"
        assert len(completed[0]) + len(completed[1]) == step, (step, completed)
    done = sorted(n for n in os.listdir(directory) if n.startswith("dcp-step-"))
    assert len(done) == STEPS and not [n for n in os.listdir(directory) if n.endswith(".tmp")]
    state: dict[str, Any] = {"w": torch.zeros(1000), "step": -1}
    dcp.load(state, checkpoint_id=os.path.join(directory, done[-1]))
    assert bool(torch.all(state["w"] == 0.0)) and state["step"] == 0  # rank 0's copy is read
