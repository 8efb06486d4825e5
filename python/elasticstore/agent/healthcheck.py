"""The default health check's program: one process per local worker slot (``--nproc-per-node``),
forked from the agent's fork server (warm start: torch is already imported) or run as
``python -u healthcheck.py`` (plain processes), each with a local rank and the node's count.

Each process joins a gloo group of the node's processes (a ``FileStore`` in the check's own
directory: no port), checks an ``all_reduce`` (the sum of every rank's ``rank + 1``), checks one
``ones @ ones`` product (every entry must be the size, exactly) and times ``--reps`` products of
random ``--size`` x ``--size`` float32 matrices (after one untimed); then prints one line
``ELASTICSTORE_HEALTH {json}`` (``rank``, ``init_ms``, ``all_reduce_ms``, ``matmul_ms``: the
median, ``matmul_max_ms``) and exits 0. Any error: a traceback and exit 1. The agent
(``healthrun.py``) kills the processes when the check's time is up and judges the times.

Standard library and torch only: run as a script, this file's directory (the agent package) is
taken off ``sys.path`` first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

MARK = "ELASTICSTORE_HEALTH "


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="healthcheck.py")
    p.add_argument("--store", required=True, help="the FileStore's file (created by rank 0's init)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True, help="seconds, for gloo")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _args(argv)
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=args.timeout))
    t1 = time.perf_counter()
    try:
        x = torch.full((1024,), float(args.rank + 1))
        dist.all_reduce(x)
        want = args.world * (args.world + 1) / 2
        if not bool(torch.all(x == want)):
            raise RuntimeError(f"all_reduce gave {x[0].item()} where {want} was due")
        t2 = time.perf_counter()
        n = args.size
        ones = torch.ones(n, n)
        if not bool(torch.all(ones @ ones == float(n))):
            raise RuntimeError(f"matmul: ones({n}, {n}) @ ones({n}, {n}) is not {n} everywhere")
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # untimed: the first product pays for what a BLAS sets up once
        times = []
        for _ in range(max(1, args.reps)):
            s = time.perf_counter()
            a @ b
            times.append((time.perf_counter() - s) * 1000)
    finally:
        dist.destroy_process_group()
    print(MARK + json.dumps({
        "rank": args.rank, "init_ms": (t1 - t0) * 1000, "all_reduce_ms": (t2 - t1) * 1000,
        "matmul_ms": statistics.median(times), "matmul_max_ms": max(times)}), flush=True)
    return 0


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.exit(main(sys.argv[1:]))
