"""The training script of the Slurm tests: gloo across the round's world, one all_reduce a step,
resumed from a checkpoint file, each step recorded as a fact the test reads.

``slurm_train.py --dir D --steps S [--sleep T]``: trains from the step after the one in
``D/ckpt.json`` (written by rank 0 after every step, atomically) to step ``S``. Each step appends a
line to ``D/rec-<host>-<pid>.jsonl``: host, rank, world size, node rank (``GROUP_RANK``), the
agent's restart count, Slurm's ``SLURM_RESTART_COUNT``, the step and the wall clock time. A
SIGTERM is recorded (``D/term-<host>-<pid>.json``: the step it came at) and ends the worker with
143 after the step in flight.

``--snapshots CKPT_DIR --checkpoint-every N``: the state (the step and a tensor of it) is kept by
``elasticstore.train.Snapshots`` instead (a snapshot every step, a disk checkpoint in ``CKPT_DIR``
every ``N`` steps) and resumed with its ``restore()``; each record says where the run resumed
from (``source``: memory, peer or disk; None when it started afresh).
"""

import json
import os
import signal
import socket
import sys
import time


def main() -> None:
    argv = sys.argv
    directory = argv[argv.index("--dir") + 1]
    steps = int(argv[argv.index("--steps") + 1])
    pause = float(argv[argv.index("--sleep") + 1]) if "--sleep" in argv else 0.1
    host = socket.gethostname()
    termed: list[float] = []
    signal.signal(signal.SIGTERM, lambda *_: termed.append(time.time()))
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = os.path.join(directory, "ckpt.json")
    start = torch.tensor([0])
    snaps, source = None, None
    if "--snapshots" in argv:
        from elasticstore.train import Snapshots

        snaps = Snapshots(every=1, checkpoint_dir=argv[argv.index("--snapshots") + 1],
                          checkpoint_every=int(argv[argv.index("--checkpoint-every") + 1]))
        restored = snaps.restore()
        if restored is not None:
            assert torch.equal(restored.state["w"], torch.full((64,), float(restored.step)))
            start[0], source = restored.state["step"] + 1, restored.source
    elif rank == 0 and os.path.exists(ckpt):
        with open(ckpt) as f:
            start[0] = int(json.load(f)["step"]) + 1
    dist.broadcast(start, 0)
    base = {"host": host, "rank": rank, "world": world, "node_rank": int(os.environ["GROUP_RANK"]),
            "attempt": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
            "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")), "pid": os.getpid(),
            "source": source}
    with open(os.path.join(directory, f"rec-{host}-{os.getpid()}.jsonl"), "a", buffering=1) as out:
        for step in range(int(start.item()), steps + 1):
            ones = torch.ones(1)
            dist.all_reduce(ones)
            assert int(ones.item()) == world, (ones, world)
            if snaps is not None:
                snaps.snapshot({"step": step, "w": torch.full((64,), float(step))}, step)
            elif rank == 0:
                tmp = f"{ckpt}.{os.getpid()}"
                with open(tmp, "w") as f:
                    json.dump({"step": step}, f)
                os.replace(tmp, ckpt)
            out.write(json.dumps(dict(base, step=step, t=time.time())) + "\n")
            if termed:
                with open(os.path.join(directory, f"term-{host}-{os.getpid()}.json"), "w") as f:
                    json.dump(dict(base, step=step, t=termed[0]), f)
                os._exit(143)
            time.sleep(pause)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
