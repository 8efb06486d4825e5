"""Local processes form a gloo process group on an elasticstore server and all-reduce a tensor.

    python examples/gloo_allreduce.py --nproc 4

The parent hosts the native store in-process (``elasticstore.StoreServer``); each worker connects
with ``elasticstore.Store`` and hands it to ``torch.distributed.init_process_group``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import elasticstore

JOIN_TIMEOUT_S = 120.0


def worker(rank: int, world_size: int, host: str, port: int) -> None:
    store = elasticstore.Store(host, port, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    evens = dist.new_group([r for r in range(world_size) if r % 2 == 0])
    if rank % 2 == 0:
        even_total = torch.tensor([float(rank + 1)])
        dist.all_reduce(even_total, group=evens)
    dist.barrier()
    expected = world_size * (world_size + 1) / 2
    status = "ok" if total.item() == expected else f"WRONG (expected {expected})"
    # One write per line, so that the workers' lines do not interleave.
    sys.stdout.write(f"rank {rank}/{world_size}: all_reduce sum = {total.item():g} {status}\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    if total.item() != expected:
        sys.exit(1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="number of worker processes")
    parser.add_argument("--host", default="127.0.0.1", help="address the store listens on")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error(f"argument --nproc: {args.nproc} is not a positive process count")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    with elasticstore.StoreServer(args.host, 0) as server:
        print(f"store listening on {server.address}; starting {args.nproc} workers", flush=True)
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=worker, args=(r, args.nproc, server.host, server.port))
            for r in range(args.nproc)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        failed = [p for p in procs if p.exitcode != 0]
        for p in failed:
            if p.is_alive():
                p.kill()
                p.join()
    elapsed = time.monotonic() - started
    if failed:
        print(f"{len(failed)} of {args.nproc} workers failed", file=sys.stderr)
        return 1
    print(f"{args.nproc} workers done in {elapsed:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
