"""What an in-memory snapshot costs (``elasticstore.train.Snapshots``), printed as a table.

1. ``snapshot()`` per call, into a real directory under /dev/shm (as the agent gives it), for the
   state of ``examples/train_ddp.py`` (model, SGD with momentum, sampler, epoch totals) and for a
   100 MB state (25 float32 tensors of 4 MB and plain objects); and what a restore from this
   node's memory costs (``restore()`` without a process group).
2. ``examples/train_ddp.py`` under ``elasticstore-run --standalone --nproc-per-node 2`` with a
   snapshot every step (its default) and with ``--snapshot-every 0`` (snapshots only at its disk
   checkpoints, as before snapshots existed): time per step from the example's summary, runs
   interleaved in pairs; the medians of ``--runs`` each, and the median of the pairs' ratios (on
   a shared machine the load changes between pairs more than within one).

    python benchmarks/snapshot.py [--runs 3] [--calls 200] [--skip-example]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

from elasticstore.train import ElasticDistributedSampler, SnapshotSettings, Snapshots

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_ddp.py")


def example_state() -> dict[str, Any]:
    """The state train_ddp.py snapshots, at its default sizes, after one step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model(torch.randn(32, 16)).sum().backward()
    opt.step()
    sampler = ElasticDistributedSampler(list(range(4096)), num_replicas=2, rank=0, seed=0)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "sampler": sampler.state_dict(), "epoch_stats": {"0": [1.0, 2.0, 3.0]},
            "last_loss": torch.zeros(1)}


def big_state(mb: int = 100) -> dict[str, Any]:
    n = mb // 4
    return {"model": {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(n)},
            "step": 1, "sampler": {"epoch": 0, "samples_consumed": 0}, "note": "x" * 100}


def time_snapshots(state: dict[str, Any], calls: int, shm: str) -> dict[str, float]:
    d = tempfile.mkdtemp(dir=shm)
    try:
        snaps = Snapshots(settings=SnapshotSettings(d, 0))
        times = []
        for step in range(1, calls + 1):
            snaps.snapshot(state, step)
            times.append(snaps.last_copy_s)
        size = snaps.last_bytes
        t0 = time.perf_counter()
        restored = Snapshots(settings=SnapshotSettings(d, 0)).restore()
        restore_s = time.perf_counter() - t0
        assert restored is not None and restored.step == calls and restored.source == "memory"
        snaps.close()
    finally:
        shutil.rmtree(d)
    times.sort()
    return {"bytes": size, "median_s": statistics.median(times),
            "p90_s": times[int(0.9 * (len(times) - 1))], "restore_s": restore_s}


def run_example(workdir: str, every: int, tag: str) -> dict[str, Any]:
    summary = os.path.join(workdir, f"{tag}.json")
    args = ["--epochs", "4", "--dataset-size", "8192", "--checkpoint-dir",
            os.path.join(workdir, f"ckpt-{tag}"), "--summary", summary, "--log-every", "1000",
            "--snapshot-every", str(every)]
    cmd = [sys.executable, "-m", "elasticstore.run", "--standalone", "--nproc-per-node", "2",
           EXAMPLE, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    with open(summary) as f:
        result: dict[str, Any] = json.load(f)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--big-calls", type=int, default=20)
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument("--skip-example", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(1)

    print("| state | bytes | snapshot() median | p90 | restore from memory |")
    print("|---|---:|---:|---:|---:|")
    for name, state, calls in (("train_ddp.py's", example_state(), a.calls),
                               ("100 MB", big_state(), a.big_calls)):
        r = time_snapshots(state, calls, a.shm)
        print(f"| {name} | {r['bytes']:,} | {r['median_s'] * 1e3:.3f} ms | "
              f"{r['p90_s'] * 1e3:.3f} ms | {r['restore_s'] * 1e3:.1f} ms |", flush=True)
    if a.skip_example:
        return 0

    workdir = tempfile.mkdtemp(prefix="snapshot-bench-")
    try:
        per_step: dict[int, list[float]] = {0: [], 1: []}
        for i in range(a.runs):
            for every in (0, 1):
                s = run_example(workdir, every, f"e{every}-{i}")
                per_step[every].append(s["elapsed_s"] / s["steps"])
        off, on = statistics.median(per_step[0]), statistics.median(per_step[1])
        print()
        print("| train_ddp.py, 2 workers, elasticstore-run | step time (median of runs) | runs |")
        print("|---|---:|---|")
        print(f"| snapshots only at disk checkpoints (--snapshot-every 0) | {off * 1e3:.3f} ms | "
              f"{', '.join(f'{x * 1e3:.3f}' for x in per_step[0])} |")
        print(f"| a snapshot every step (default) | {on * 1e3:.3f} ms | "
              f"{', '.join(f'{x * 1e3:.3f}' for x in per_step[1])} |")
        ratios = sorted(b / a for a, b in zip(per_step[0], per_step[1]))
        print(f"\nstep time with a snapshot every step: {100 * (on / off - 1):+.1f}% (medians), "
              f"{100 * (statistics.median(ratios) - 1):+.1f}% (median of the pairs' ratios: "
              f"{', '.join(f'{100 * (r - 1):+.0f}%' for r in ratios)})")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
