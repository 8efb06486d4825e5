"""A gloo job for the torchrun tests: ``rdzv_train.py OUTDIR STEPS STEP_SECONDS``.

Each worker all-reduces ones STEPS times (checking the sum is the world size), writes
``started-{rank}-{world}`` after the first step and ``done-{rank}-{world}`` at the end."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    outdir, steps, step_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert int(t.item()) == world, (t.item(), world)
        if step == 0:
            open(os.path.join(outdir, f"started-{rank}-{world}"), "w").close()
        time.sleep(step_s)
    dist.barrier()
    open(os.path.join(outdir, f"done-{rank}-{world}"), "w").close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
