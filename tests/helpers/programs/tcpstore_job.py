"""A training script written for torchrun, unchanged: ``init_process_group()`` with no arguments
(torch's own ``env://`` TCPStore client), gloo all_reduce, new_group and barrier. Reports what it
saw with :func:`report`: a file of its own per rank (several workers share torchrun's stdout,
where their lines could interleave), and one whole line on stdout."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    even_total = torch.tensor([float(rank + 1)])
    if rank % 2 == 0:
        dist.all_reduce(even_total, group=evens)
    dist.barrier()
    result = {
        "rank": rank,
        "world": world,
        "sum": total.item(),
        "even_sum": even_total.item() if rank % 2 == 0 else None,
        "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
    }
    dist.destroy_process_group()
    report(result)


RESULTS_ENV = "ELASTICSTORE_JOB_RESULTS"


def report(result: dict[str, Any]) -> None:
    """Writes ``result`` to ``$ELASTICSTORE_JOB_RESULTS/rank-{rank}.json`` (whole, by a rename)
    and as one line on stdout in a single write."""
    line = json.dumps(result) + "\n"
    out_dir = os.environ.get(RESULTS_ENV)
    if out_dir:
        path = os.path.join(out_dir, f"rank-{result['rank']}.json")
        with open(path + ".tmp", "w") as f:
            f.write(line)
        os.replace(path + ".tmp", path)
    os.write(1, line.encode())


if __name__ == "__main__":
    main()
