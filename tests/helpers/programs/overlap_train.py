"""Trains a 12 MB model with Adam, a snapshot every step (``Snapshots`` of local rank 0 in
SNAPSHOT_DIR), saving each step's state to ``OUT/state-<step>.pt`` first; after ``snapshot(STOP)``
it prints ``pending STOP`` and sleeps before its next optimizer step (the test SIGKILLs it).
With ``fork``: instead it forks, the child takes an optimizer step (it must not wait for, nor
publish, its parent's copy) and exits; then the parent steps (publishing STOP), prints
``forked CHILD_EXIT_STATUS NEWEST_STEP`` and exits.

    python overlap_train.py SNAPSHOT_DIR OUT STOP [fork]
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

from elasticstore.train import SnapshotSettings, Snapshots


def main() -> int:
    directory, out, stop = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.BatchNorm1d(1024), nn.Linear(1024, 8))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    snaps = Snapshots(settings=SnapshotSettings(directory, 0))
    for step in range(1, stop + 1):
        x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()
        state = {"model": model.state_dict(), "optim": optim.state_dict(), "step": step}
        torch.save(state, os.path.join(out, f"state-{step}.pt"))
        snaps.snapshot(state, step)
        if snaps.last_background_bytes == 0:
            print("not overlapped", step, flush=True)
            return 1
    if sys.argv[4:] == ["fork"]:
        child = os.fork()
        if child == 0:
            optim.step()
            os._exit(0)
        _, status = os.waitpid(child, 0)
        optim.step()
        from elasticstore.train.snapshots.fileformat import list_snapshots

        print("forked", os.waitstatus_to_exitcode(status), list_snapshots(directory)[-1][0],
              flush=True)
        snaps.close()
        return 0
    print("pending", stop, flush=True)
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
