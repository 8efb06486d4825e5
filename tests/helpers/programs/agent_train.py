"""A training script written for torchrun (env://, @record), driven by the agent tests.

Records what it sees in ``--dir``: ``start-<attempt>-<rank>.json`` at the top of the script (pid,
whether torch was already imported, time from fork to here, __name__, argv, __file__) and
``init-<attempt>-<rank>`` once past ``init_process_group``. Runs all_reduce steps until the file
``release`` exists in ``--dir`` (decided by a MAX all_reduce, so every rank stops at one step).
"""

import json
import os
import sys
import time

_STARTED = time.time()
_PRELOADED = "torch" in sys.modules


def _start_ticks(pid: str) -> int | None:
    """When process ``pid`` ("self", or a number) started, in clock ticks since boot: with the
    pid, what names the process for the tests' clean-up (``agent_nodes.Agents.all_pids``: pids
    are reused). None where /proc does not show it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def main() -> None:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-attempt", type=int, default=None, help="fail in this attempt only")
    p.add_argument("--child", action="store_true", help="start a child process that sleeps")
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--exit-delay", type=float, default=0.0,
                   help="seconds to linger after training (this node's workers finish later)")
    p.add_argument("--local-rank", "--local_rank", type=int, default=None)  # the legacy launcher
    p.add_argument("--init-method", default=None, help="e.g. tcp://localhost:PORT (else env://)")
    args = p.parse_args()
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("ELASTICSTORE_ATTEMPT") or os.environ["TORCHELASTIC_RESTART_COUNT"])
    forked = os.environ.get("ELASTICSTORE_FORKED_AT")
    info = {
        "pid": os.getpid(), "pid_ticks": _start_ticks("self"), "rank": rank, "attempt": attempt, "preloaded": _PRELOADED,
        "fork_to_main": _STARTED - float(forked) if forked else None, "name": __name__,
        "argv": sys.argv, "local_rank_arg": args.local_rank, "file": __file__, "world": int(os.environ["WORLD_SIZE"]),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("TORCHELASTIC", "ELASTICSTORE",
                "MASTER", "GROUP", "ROLE", "LOCAL", "OMP", "TORCH_NCCL")) or k in ("RANK", "WORLD_SIZE")},
    }
    if args.child:
        import subprocess

        info["child"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid
        info["child_ticks"] = _start_ticks(str(info["child"]))
    path = os.path.join(args.dir, f"start-{attempt}-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)
    if rank == args.fail_rank and args.fail_attempt in (None, attempt):
        raise RuntimeError(f"rank {rank} fails on purpose")

    import torch
    import torch.distributed as dist

    if args.init_method:
        from datetime import timedelta

        dist.init_process_group("gloo", init_method=args.init_method, rank=rank,
                                world_size=info["world"], timeout=timedelta(seconds=60))
    else:
        dist.init_process_group("gloo")
    with open(os.path.join(args.dir, f"init-{attempt}-{rank}"), "w") as f:
        f.write(repr(time.time()))
    release = os.path.join(args.dir, "release")
    for _ in range(args.steps):
        flag = torch.tensor([1.0 if os.path.exists(release) else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            break
        time.sleep(0.05)
    dist.destroy_process_group()
    time.sleep(args.exit_delay)
    print(f"rank {rank} done at world size {info['world']}", flush=True)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
