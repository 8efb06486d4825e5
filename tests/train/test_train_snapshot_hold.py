"""The replica hold (``train/snapshots/hold.py``) as the snapshot writer honours it, in one process
writing into a real directory under /dev/shm: a held step's file survives any number of
snapshots, each intact, with never more than ``KEEP_PER_RANK`` + 2 files of the rank; a step no
longer held is reused (the same memory: its inode) or freed; without the file, ``KEEP_PER_RANK``
as before; a file that is not the agent's is ignored with a warning."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch

from elasticstore.train import KEEP_PER_RANK, SnapshotSettings, Snapshots
from elasticstore.train.snapshots.fileformat import list_snapshots, read_snapshot, snapshot_name
from elasticstore.train.snapshots.hold import HOLD_NAME, Hold, remove_hold, write_hold


def state(step: int) -> dict[str, Any]:
    return {"step": step, "w": torch.full((50_000,), float(step))}


def steps(directory: str) -> list[int]:
    return [s for s, _, _ in list_snapshots(directory)]


def intact(directory: str, step: int) -> bool:
    got, _, st = read_snapshot(os.path.join(directory, snapshot_name(step, 0)))
    return got == step and st["step"] == step and bool(torch.all(st["w"] == step))


def test_held_steps_survive_and_are_reused_once_released(shm_root: str) -> None:
    directory = os.path.join(shm_root, "node")
    os.mkdir(directory)
    snaps = Snapshots(settings=SnapshotSettings(directory, 0))

    def run(first: int, last: int, held: list[int]) -> None:
        for step in range(first, last + 1):
            assert snaps.snapshot(state(step), step)
            found = steps(directory)
            assert len(found) <= KEEP_PER_RANK + 2, found
            assert found[-KEEP_PER_RANK:] == list(range(max(1, step - KEEP_PER_RANK + 1), step + 1))
            for h in held:
                assert h > step or h in found, (h, found)
    try:
        write_hold(directory, Hold(None, 3))  # the step the agents send: the first >= 3
        run(1, 12, [3])
        assert steps(directory) == [3, 11, 12] and intact(directory, 3)
        write_hold(directory, Hold(3, 15))  # 3 committed; the next to send: >= 15
        run(13, 20, [3, 15])
        assert steps(directory) == [3, 15, 19, 20] and intact(directory, 3)
        three = os.stat(os.path.join(directory, snapshot_name(3, 0))).st_ino
        write_hold(directory, Hold(15, 30))  # 15 committed: 3 is released
        run(21, 21, [15])
        assert steps(directory) == [15, 20, 21]  # 19 freed
        assert os.stat(os.path.join(directory, snapshot_name(21, 0))).st_ino == three  # reused
        assert intact(directory, 15) and intact(directory, 21)
        remove_hold(directory)  # no file: today's rule
        run(22, 23, [])
        assert steps(directory) == [22, 23]
        with open(os.path.join(directory, HOLD_NAME), "w") as f:
            f.write('{"committed": "x"}')
        with pytest.warns(RuntimeWarning, match="ignoring the replica hold file"):
            run(24, 25, [])
        assert steps(directory) == [24, 25]
        restored = snaps.restore()
        assert restored is not None and restored.step == 25
    finally:
        snaps.close()
        shutil.rmtree(directory)
