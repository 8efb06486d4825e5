"""Two or more gloo ranks with the heartbeat patterns of real training scripts (``--mode``):

- ``eval``: every rank beats each step; at ``--at`` rank 0 evaluates for ``--eval`` seconds inside
  ``section("eval", timeout=None)`` while the others wait in ``dist.barrier()``; then all go on.
- ``rank0``: only rank 0 calls ``heartbeat()`` (a rank-0-only callback); every rank all_reduces
  every step.
- ``deadlock``: every rank beats a few steps, then each waits in ``dist.recv`` for the next rank
  (nobody sends): every rank waits in a collective, nobody is hung in its own code.

Records in ``--dir``: ``start-<attempt>-<rank>.json`` (its pid, for the tests' clean-up),
``init-<attempt>-<rank>`` and ``done-<rank>``. Runs ``--steps`` steps of ``--step-time`` s.
"""

import argparse
import json
import os
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--mode", choices=("eval", "rank0", "deadlock"), required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--at", type=int, default=5)
    p.add_argument("--eval", type=float, default=6.0)
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    from elasticstore.train import heartbeat, section

    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    world = int(os.environ["WORLD_SIZE"])
    with open(os.path.join(args.dir, f"start-{attempt}-{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "rank": rank, "attempt": attempt, "world": world}, f)
    dist.init_process_group("gloo")
    with open(os.path.join(args.dir, f"init-{attempt}-{rank}"), "w") as f:
        f.write(repr(time.time()))
    x = torch.ones(4)
    for step in range(1, args.steps + 1):
        time.sleep(args.step_time)
        dist.all_reduce(x)
        if args.mode != "rank0" or rank == 0:
            heartbeat()
        if step == args.at and args.mode == "eval":
            if rank == 0:
                with section("eval", timeout=None):
                    time.sleep(args.eval)
            dist.barrier()
        if step == args.at and args.mode == "deadlock":
            dist.recv(x, src=(rank + 1) % world)
    dist.destroy_process_group()
    with open(os.path.join(args.dir, f"done-{rank}"), "w") as f:
        f.write(repr(time.time()))
    print(f"rank {rank} done after {args.steps} steps (attempt {attempt})", flush=True)


if __name__ == "__main__":
    main()
