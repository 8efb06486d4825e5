"""Snapshots of FSDP2 state beside ``torch.distributed.checkpoint.async_save``, in one run.

Two processes (gloo, one thread each, as under a launcher), ``fully_shard`` over 8
``Linear(1024, 1024)`` layers with AdamW: a 100 MB state (weights and the two moments; 50 MB per
rank), the state dict from ``get_state_dict``. Every step is a real one (forward, backward,
optimizer step; the parameters all-gathered per layer); the modes take turns step by step:
``off``; ``snapshot`` (the default: the optimizer's shards copied while the next step computes,
the wait at the next optimizer step counted as blocking); ``snapshot, overlap=False`` (the copy
before ``snapshot`` returns); and ``dcp.async_save`` into a directory under the snapshot file
system, whose call blocks for its staging (its write is waited for after the step, outside the
timed part). Rank 0's medians after the first ``--warmup`` steps (the buffers are made then).

    python benchmarks/snapshot_fsdp.py [--steps 48] [--shm /dev/shm] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # snapshot_steps, machine
import snapshot_steps  # noqa: E402

MODES = ("off", "snapshot", "snapshot, overlap=False", "dcp.async_save")


def worker(steps: int, work: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elasticstore.train import SnapshotSettings, Snapshots

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    local = int(os.environ["LOCAL_RANK"])
    overlapped = Snapshots(settings=SnapshotSettings(work, local))
    blocking = Snapshots(settings=SnapshotSettings(work, 2 + local), overlap=False)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    blocked: dict[str, list[float]] = {m: [] for m in MODES}
    previous, size = "", 0
    for step in range(1, steps + 1):
        mode = MODES[step % len(MODES)]
        dist.barrier()
        started = time.perf_counter()
        x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(step * 10 + rank))
        model(x).square().mean().backward()
        overlapped.last_wait_s = 0.0
        optim.step()  # waits for the overlapped copy of the step before, if it still runs
        optim.zero_grad()
        if previous == "snapshot":
            blocked["snapshot"][-1] += overlapped.last_wait_s
        t0 = time.perf_counter()
        future: Any = None
        if mode != "off":
            msd, osd = get_state_dict(model, optim)
            state = {"model": msd, "optim": osd, "step": step}
            if mode == "snapshot":
                overlapped.snapshot(state, step)
                size = overlapped.last_bytes
            elif mode == "snapshot, overlap=False":
                blocking.snapshot(state, step)
            else:
                future = dcp.async_save(state, checkpoint_id=os.path.join(work, f"dcp-{step}"))
        blocked[mode].append(time.perf_counter() - t0)
        times[mode].append(time.perf_counter() - started)
        previous = mode
        if future is not None:
            getattr(future, "upload_completion", future).result()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(os.path.join(work, f"dcp-{step}"), ignore_errors=True)
    overlapped.close()
    blocking.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "blocked": blocked, "bytes": size}, f)
    dist.destroy_process_group()


def run(steps: int, shm: str, warmup: int) -> dict[str, Any]:
    r = snapshot_steps.run_two_ranks(
        lambda rank, work, out: [os.path.abspath(__file__), "--worker", str(steps), work, out],
        "snapshot-fsdp-", shm, 1200)
    skip = warmup // len(MODES)
    return {"bytes": r["bytes"], "steps": {m: len(t) - skip for m, t in r["times"].items()},
            "step_median_s": {m: statistics.median(t[skip:]) for m, t in r["times"].items()},
            "blocked_median_s": {m: statistics.median(t[skip:]) for m, t in r["blocked"].items()},
            "blocked_range_s": {m: (min(t[skip:]), max(t[skip:]))
                                for m, t in r["blocked"].items()}}


def table(r: dict[str, Any]) -> list[str]:
    off = r["step_median_s"]["off"]
    names = {"off": "no snapshot",
             "snapshot": "`snapshot()` (default: overlapped; the wait at the next optimizer step "
                         "included)",
             "snapshot, overlap=False": "`snapshot()`, `overlap=False`",
             "dcp.async_save": "`dcp.async_save` (its staging)"}
    out = [f"FSDP2, 2 ranks on gloo, AdamW, {r['bytes'] / 1e6:.0f} MB snapshot per rank; "
           f"{r['steps']['off']} steps per mode, in turn (rank 0):", "",
           "| mode | blocks the step (median) | range | share of the step | step (median) |",
           "|---|---:|---:|---:|---:|"]
    for m in MODES:
        b, (lo, hi) = r["blocked_median_s"][m], r["blocked_range_s"][m]
        out.append(f"| {names[m]} | {b * 1e3:.2f} ms | {lo * 1e3:.2f}-{hi * 1e3:.2f} ms | "
                   f"{100 * b / off:.1f}% | {r['step_median_s'][m] * 1e3:.1f} ms |")
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    a = p.parse_args()
    from machine import machine

    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    r = run(a.steps, a.shm, a.warmup)
    info = machine()
    head = (f"`python benchmarks/snapshot_fsdp.py`, {started}; {info['cores']} cores, "
            f"{info['cpu']}, {info['kernel']}, Python {info['python']}; load average (1 min) "
            f"{load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after.")
    md = table(r)
    print("\n".join(md) + "\n\n" + head)
    if a.out:
        with open(f"{a.out}.json", "w") as f:
            json.dump({"started": started, "machine": info, **r}, f, indent=1)
        with open(f"{a.out}.md", "w") as f:
            f.write("# Snapshots of FSDP2 state\n\n" + head + "\n\n" + "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
