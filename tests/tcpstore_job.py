"""A training script written for torchrun, unchanged: ``init_process_group()`` with no arguments
(torch's own ``env://`` TCPStore client), gloo all_reduce, new_group and barrier. Prints one JSON
line with what it saw."""

from __future__ import annotations

import json
import os

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
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
