"""A DDP (gloo) script that destroys its process group while the DDP model is still alive (as
accelerate's ``end_training()`` does), then returns. ``--fail-rank R``: rank R fails in attempt 0
after one step, so the next round is a restart. Writes ``done-<attempt>-<rank>`` to ``--dir``."""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

args = sys.argv[1:]
out = args[args.index("--dir") + 1]
fail = int(args[args.index("--fail-rank") + 1]) if "--fail-rank" in args else -1
rank, attempt = int(os.environ["RANK"]), int(os.environ.get("ELASTICSTORE_ATTEMPT") or os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
# Several gradient buckets: several allreduce works in flight at the end of each backward.
model = DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]),
                                bucket_cap_mb=0.25)
for _ in range(3):
    model.zero_grad()
    model(torch.randn(8, 256)).sum().backward()
if attempt == 0 and rank == fail:
    sys.exit(1)
dist.destroy_process_group()  # the DDP model (its reducer) is freed only after this
with open(os.path.join(out, f"done-{attempt}-{rank}"), "w") as f:
    f.write("ok")
