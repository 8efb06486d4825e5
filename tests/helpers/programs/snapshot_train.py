"""A training loop for the snapshot tests, under elasticstore-run (gloo, env://).

Its state, snapshotted every step: the step, the elastic sampler's position over a dataset of
``--dataset-size`` indices, per-epoch counts of every index trained on (all-reduced each step, the
same on every rank), a tensor whose size changes with the step, and plain Python objects, all a
function of the step. Records in ``--dir``:

- ``restore-<attempt>-<rank>.json``: what ``Snapshots.restore`` returned (step, source, detail) and
  whether the state is exactly the one of that step;
- ``done-<attempt>-<rank>``: the newest step whose snapshot this rank published;
- ``result-<attempt>-<rank>.json`` at the end: the per-epoch counts (each index once: all ones) and
  the most snapshot files this local rank ever had at once.

``--checkpoint-dir``/``--checkpoint-every``: disk checkpoints written from the snapshots (by rank
0); ``--stop-at-step N``: every rank ends cleanly after step N (its disk checkpoints written), as a
job stopped part way that a later job resumes.
"""

import argparse
import json
import os
import sys
import time
from typing import Any


def payload(step: int) -> Any:
    import torch

    return torch.arange(1000 * (step % 4 + 1), dtype=torch.float32) + step


def objects(step: int) -> Any:
    return {"step": step, "text": "s" * (step % 7), "nested": [step, (step, "x"), {"k": step * 0.5}],
            "none": None}


def write_json(path: str, value: Any) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--dataset-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--fail-at-step", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--stop-at-step", type=int, default=-1)
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    from elasticstore.train import KEEP_PER_RANK, ElasticDistributedSampler, Snapshots
    from elasticstore.train.snapshots.fileformat import list_snapshots

    attempt = int(os.environ.get("ELASTICSTORE_ATTEMPT") or os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    snap_dir = os.environ.get("ELASTICSTORE_SNAPSHOT_DIR")
    sampler = ElasticDistributedSampler(list(range(args.dataset_size)), seed=7)
    counts = torch.zeros(args.epochs, args.dataset_size, dtype=torch.float64)
    step = 0
    snaps = Snapshots(every=1, checkpoint_dir=args.checkpoint_dir,
                      checkpoint_every=args.checkpoint_every)
    restored = snaps.restore()
    record: dict[str, Any] = {"world": world, "step": None}
    if restored is not None:
        st = restored.state
        exact = (st["step"] == restored.step and torch.equal(st["payload"], payload(restored.step))
                 and st["objects"] == objects(restored.step))
        record.update(step=restored.step, source=restored.source, detail=restored.detail,
                      exact=exact)
        sampler.load_state_dict(st["sampler"])
        counts = st["counts"]
        step = restored.step
    write_json(os.path.join(args.dir, f"restore-{attempt}-{rank}.json"), record)

    most = 0
    for epoch in range(sampler.epoch, args.epochs):
        if step == args.stop_at_step:
            break
        sampler.set_epoch(epoch)
        indices = list(sampler)
        for i in range(0, len(indices), args.batch_size):
            if step == args.stop_at_step:
                break
            batch = indices[i:i + args.batch_size]
            if step + 1 == args.fail_at_step and rank == args.fail_rank and attempt == 0:
                os._exit(3)
            delta = torch.zeros(args.dataset_size, dtype=torch.float64)
            delta[batch] += 1
            dist.all_reduce(delta)
            counts[epoch] += delta
            sampler.advance(len(batch))
            step += 1
            snaps.snapshot({"step": step, "sampler": sampler.state_dict(), "counts": counts,
                            "payload": payload(step), "objects": objects(step)}, step)
            if snap_dir is not None:
                mine = [s for s, lr, _ in list_snapshots(snap_dir) if lr == local_rank]
                most = max(most, len(mine))
            with open(os.path.join(args.dir, f"done-{attempt}-{rank}"), "w") as f:
                f.write(str(step))
            time.sleep(args.step_time)
    snaps.close()
    write_json(os.path.join(args.dir, f"result-{attempt}-{rank}.json"),
               {"counts_ok": bool((counts == 1).all()), "steps": step, "most_files": most,
                "keep": KEEP_PER_RANK})
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
