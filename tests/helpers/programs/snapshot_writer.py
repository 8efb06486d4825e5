"""Takes snapshots as fast as it can into a directory (``Snapshots`` of one local rank): every
tensor of step ``s`` holds ``s`` (float32 and int64), so a reader can tell a snapshot that is not
one step's. Prints each step once taken, then sleeps ``pause`` seconds (default 0); stops after
``steps`` (the tests kill it sooner).

    python snapshot_writer.py DIRECTORY MEGABYTES STEPS [PAUSE]
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from elasticstore.train import SnapshotSettings, Snapshots


def main() -> int:
    directory, megabytes, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    torch.set_num_threads(1)  # as under a launcher: the snapshot's own threads do the copy
    n = max(1, megabytes * 2**20 // 4 // 4)
    state: dict[str, Any] = {"a": torch.zeros(n), "b": torch.zeros(n), "c": torch.zeros(n),
             "i": torch.zeros(n, dtype=torch.int64)[: n // 2], "step": 0}
    with Snapshots(settings=SnapshotSettings(directory, 0)) as snaps:
        for step in range(1, steps + 1):
            for key in "abci":
                state[key].fill_(step)
            state["step"] = step
            snaps.snapshot(state, step)
            print(step, flush=True)
            if pause:
                time.sleep(pause)
    return 0


if __name__ == "__main__":
    sys.exit(main())
