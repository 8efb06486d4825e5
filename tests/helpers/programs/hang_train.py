"""A gloo training loop that beats once per step (``elasticstore.train.heartbeat``) and, on
purpose, hangs one rank in its first attempt: ``--hang sleep`` blocks in user code, ``--hang stop``
SIGSTOPs itself, ``--hang slow`` (no hang) sleeps ``--slow`` seconds inside ``section("compute")``
every step. Every other rank then blocks in its next all_reduce.

Records in ``--dir``: ``start-<attempt>-<rank>.json`` (its pid, for the tests' clean-up),
``init-<attempt>-<rank>`` (time past init_process_group), ``hang`` (time the
rank stopped beating), ``done-<rank>`` at the end. Runs ``--steps`` steps of ``--step-time`` s.
"""

import argparse
import json
import os
import signal
import time


def stuck_in_user_code() -> None:
    """Where the hung rank sits (the stacks must show this name)."""
    for _ in range(3600):
        time.sleep(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--hang", choices=("sleep", "stop", "slow", "none"), default="none")
    p.add_argument("--hang-rank", type=int, default=1)
    p.add_argument("--hang-step", type=int, default=10)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--slow", type=float, default=0.2)
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    from elasticstore.train import heartbeat, section

    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("ELASTICSTORE_ATTEMPT") or os.environ["TORCHELASTIC_RESTART_COUNT"])
    with open(os.path.join(args.dir, f"start-{attempt}-{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "rank": rank, "attempt": attempt,
                   "world": int(os.environ["WORLD_SIZE"])}, f)
    dist.init_process_group("gloo")
    with open(os.path.join(args.dir, f"init-{attempt}-{rank}"), "w") as f:
        f.write(repr(time.time()))
    x = torch.ones(4)
    for step in range(1, args.steps + 1):
        with section("compute"):
            time.sleep(args.step_time)
            if args.hang == "slow" and rank == args.hang_rank:
                time.sleep(args.slow)
        dist.all_reduce(x)
        heartbeat()
        if step == args.hang_step and rank == args.hang_rank and attempt == 0 and \
                args.hang in ("sleep", "stop"):
            with open(os.path.join(args.dir, "hang"), "w") as f:
                f.write(repr(time.time()))
            if args.hang == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            stuck_in_user_code()
    dist.destroy_process_group()
    with open(os.path.join(args.dir, f"done-{rank}"), "w") as f:
        f.write(repr(time.time()))
    print(f"rank {rank} done after {args.steps} steps (attempt {attempt})", flush=True)


if __name__ == "__main__":
    main()
