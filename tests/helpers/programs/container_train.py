"""A training loop for the container tests (``tests/train/test_train_containers.py``), under
elasticstore-run (gloo, env://).

Each step: one all_reduce, then ``Snapshots.snapshot`` of a state of ``--state-mib`` MiB (a
tensor filled with the step); ``--step-time`` seconds per step. Runs ``--steps`` steps, or, with
``--until-file``, until that file exists (decided by a MAX all_reduce, so every rank stops at one
step). At the end, ``result-<rank>.json`` in ``--dir``: the world size, the rank, the steps, the
newest disk checkpoint's step, the most files and bytes this rank ever saw in the snapshot
directory, and the names in it after the last snapshot.
"""

import argparse
import json
import os
import time
from typing import Any


def area_usage(directory: str | None) -> tuple[int, int, list[str]]:
    if directory is None or not os.path.isdir(directory):
        return 0, 0, []
    names = sorted(n for n in os.listdir(directory) if ".snap" in n or n.startswith(".tmp"))
    size = 0
    for name in names:
        try:
            size += os.stat(os.path.join(directory, name)).st_blocks * 512
        except FileNotFoundError:
            pass
    return len(names), size, names


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--until-file", default=None)
    p.add_argument("--state-mib", type=float, default=0.01)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--slow-disk", type=float, default=0.0,
                   help="seconds each background disk checkpoint takes at least")
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    from elasticstore.train import Snapshots, list_checkpoints

    if args.slow_disk:  # every torch.save (the disk checkpoints') takes this long at least
        real_save = torch.save

        def slow_save(*a: Any, **kw: Any) -> None:
            time.sleep(args.slow_disk)
            real_save(*a, **kw)

        torch.save = slow_save

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    snap_dir = os.environ.get("ELASTICSTORE_SNAPSHOT_DIR")
    numel = max(1, int(args.state_mib * (1 << 20)) // 4)
    most_files = most_bytes = 0
    with Snapshots(every=1, checkpoint_dir=args.checkpoint_dir,
                   checkpoint_every=args.checkpoint_every) as snaps:
        restored = snaps.restore()
        step = 0 if restored is None else restored.step
        while True:
            step += 1
            t = torch.ones(1)
            dist.all_reduce(t)
            snaps.snapshot({"w": torch.full((numel,), float(step)), "step": step}, step)
            files, used, names = area_usage(snap_dir)
            most_files, most_bytes = max(most_files, files), max(most_bytes, used)
            time.sleep(args.step_time)
            if args.until_file is None:
                if step >= args.steps:
                    break
            else:
                stop = torch.tensor([float(os.path.exists(args.until_file))])
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
                if stop.item():
                    break
    ckpts = list_checkpoints(args.checkpoint_dir) if args.checkpoint_dir else []
    result = {"world": world, "rank": rank, "steps": step, "most_files": most_files,
              "most_bytes": most_bytes, "names": names,
              "checkpoint": ckpts[-1][0] if ckpts else None,
              "restored": None if restored is None else restored.step}
    with open(os.path.join(args.dir, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
