"""The replica schedule (``elasticstore.replicas.schedule``) of two agents' services through one
round's store (real endpoints on loopback, real snapshot files written as a worker does): nodes
that place different steps for one floor get a new floor further ahead (said once), the next
common step is committed, and each receiver keeps the committed step besides its two newest
while later floors are missed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from agent_nodes import until
from elasticstore.replicas import ReplicaService
from elasticstore.train.snapshots import fileformat
from elasticstore.train.snapshots.hold import HOLD_NAME
from elasticstore.train.snapshots.identity import Identity


def write(area: str, step: int, rank: int) -> None:
    """Node ``rank``'s (one local rank) snapshot of ``step``, as its worker leaves it."""
    enc = fileformat.prepare({"w": torch.full((1000,), float(step))},
                             Identity(step, rank, 2, False, True).to_dict())
    buf = fileformat.Buffer(os.path.join(area, fileformat.tmp_name(0)))
    fileformat.encode(enc, step, buf)
    buf.rename(os.path.join(area, fileformat.snapshot_name(step, 0)))
    buf.close()


def hold(area: str) -> Any:
    try:
        with open(os.path.join(area, HOLD_NAME)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def test_different_steps_for_one_floor_move_it_and_the_committed_step_is_kept(
        tmp_path: Path) -> None:
    store = dist.HashStore()
    areas = [str(tmp_path / f"n{i}") for i in range(2)]
    said: list[str] = []
    for area in areas:
        os.mkdir(area)
    services = [ReplicaService(area, 1, host, "", said.append)
                for area, host in zip(areas, ["127.0.0.2", "127.0.0.3"])]

    def steps(node: int) -> list[int]:
        """The steps of the other node's replica that ``node``'s receiver holds."""
        return sorted(int(n[5:17]) for n in os.listdir(services[node].receiver.dir))

    def floors(want: dict[str, Any]) -> bool:
        return all(hold(a) == want for a in areas)

    try:
        for i, s in enumerate(services):
            s.new_round(store, 0, i, 2)
        for i, area in enumerate(areas):
            write(area, 1, i)
        until(lambda: floors({"committed": None, "floor": 2}), 20.0, "floor 2")
        write(areas[0], 2, 0)
        write(areas[1], 3, 1)  # node 1's step 2 was reused before its workers saw the hold
        # placed: 2 and 3; the leader's newest is 2: floor 2 + gap 2
        until(lambda: floors({"committed": None, "floor": 4}), 20.0, "floor 4")
        assert sum("the nodes placed steps [2, 3]" in line for line in said) == 1, said
        for i, area in enumerate(areas):
            write(area, 4, i)
        until(lambda: floors({"committed": 4, "floor": 6}), 20.0, "4 committed, floor 6")
        assert (steps(0), steps(1)) == ([3, 4], [2, 4])
        for floor, miss in ((6, 10), (10, 18)):  # missed again twice: gap 4, then 8
            write(areas[0], floor, 0)
            write(areas[1], floor + 1, 1)
            want = {"committed": 4, "floor": miss}
            until(lambda: floors(want), 20.0, f"floor {miss}")
        assert (steps(0), steps(1)) == ([4, 7, 11], [4, 6, 10])  # 4 kept: the committed step
        assert sum("the nodes placed steps" in line for line in said) == 1, said
    finally:
        for s in services:
            s.close()
