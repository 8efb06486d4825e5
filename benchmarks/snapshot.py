"""What an in-memory snapshot costs (``elasticstore.train.Snapshots``), printed as tables and
written to ``--out`` (``.json`` and ``.md``, with the machine and its load average).

1. ``snapshot()`` per call in a tight loop, into a real directory under /dev/shm (as the agent
   gives it), for the state of ``examples/train_ddp.py`` (model, SGD with momentum, sampler, epoch
   totals) and for a 100 MB state (25 float32 tensors of 4 MB and plain objects); and what a
   restore from this node's memory costs (``restore()`` without a process group).
2. Steps with and without a snapshot, interleaved in one run (``snapshot_steps.py``): the
   example's step (2 processes, gloo) with no snapshot, with its state built and dropped, with
   ``snapshot()`` every step, with what the example does (the snapshot plus the all_reduce of the
   totals it holds), and with ``dcp.async_save`` of the same state every step; and a 100 MB
   state with 100 ms steps, with no snapshot, with ``snapshot()``, and with
   ``torch.distributed.checkpoint.async_save``, whose call blocks for its staging (a copy).
3. With ``--runs N``: ``examples/train_ddp.py`` itself under ``elasticstore-run --standalone
   --nproc-per-node 2`` with a snapshot every step (its default) and with ``--snapshot-every 0``,
   runs interleaved in pairs (whole runs: noisier than 2 on a shared machine).

    python benchmarks/snapshot.py [--steps 2400] [--big-steps 60] [--runs 0] [--out PATH]
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

import snapshot_steps
from elasticstore.train import ElasticDistributedSampler, SnapshotSettings, Snapshots
from machine import machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_ddp.py")


def example_state() -> dict[str, Any]:
    """The state train_ddp.py snapshots, at its default sizes, after one step."""
    model, opt = snapshot_steps.example_model()
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


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def steps_tables(ex: dict[str, Any], bigs: list[dict[str, Any]]) -> list[str]:
    """The markdown of part 2."""
    off = ex["median_s"]["off"]
    out = [f"The example's step, 2 processes, gloo, one thread each ({ex['steps']['off']} steps "
           f"per mode counted, in blocks of {snapshot_steps.BLOCK}, modes in turn, the first step "
           f"of each block left out (it pays for the mode before it), one run; state "
           f"{ex['bytes']:,} bytes):", "",
           "| mode | step (median) | vs no snapshot (medians) | vs no snapshot (median of "
           "cycles) |", "|---|---:|---:|---:|"]
    names = {"off": "no snapshot", "state dicts": "the state built (its state dicts), no snapshot",
             "snapshot": "`snapshot()` every step",
             "example": "the example's: `snapshot()` + the totals' `all_reduce`",
             "dcp.async_save": "`dcp.async_save` of the state every step (its write outside "
                               "the step)"}
    for m, name in names.items():
        med = ex["median_s"][m]
        out.append(f"| {name} | {med * 1e3:.3f} ms | {_pct(med / off - 1)} | "
                   f"{_pct(ex['paired_ratio'][m] - 1)} |")
    out += ["", f"`snapshot()` blocked the step (building the state dict included) "
            f"{ex['copy_median_s'] * 1e3:.3f} ms median, p90 {ex['copy_p90_s'] * 1e3:.3f} ms: "
            f"{100 * ex['copy_median_s'] / off:.1f}% of the step without one; "
            f"`dcp.async_save` (the state built, then staged) {ex['staged_median_s'] * 1e3:.3f} ms "
            f"median, p90 {ex['staged_p90_s'] * 1e3:.3f} ms: "
            f"{ex['staged_median_s'] / ex['copy_median_s']:.1f} times as long.", ""]
    for big in bigs:
        what = ("a sleep for the rest of the step (an accelerator's time: the CPU is free)"
                if big["work"] == "sleep" else "a fixed number of matrix products on the training "
                "thread (CPU-bound, about the step time without a snapshot)")
        step = big["median_s"]["off"]  # the step without a snapshot: the share's base
        out += [f"A {big['bytes'] / 1e6:.0f} MB state, steps of {step * 1e3:.0f} ms: "
                f"an optimizer step (SGD) then {what} ({big['steps']['off']} steps per mode, in "
                f"turn; torch threads: 1, as under a launcher; the snapshot's copy threads: "
                f"{big['copy_threads']}):", "",
                "| mode | blocks the step (median) | range | share of the step | step (median) |",
                "|---|---:|---:|---:|---:|"]
        for m in snapshot_steps.BIG_MODES:
            b, (lo, hi) = big["blocked_median_s"][m], big["blocked_range_s"][m]
            name = {"off": "no snapshot",
                    "snapshot": "`snapshot()` (default: overlapped, with the wait at the next "
                                "optimizer step)",
                    "snapshot, overlap=False": "`snapshot()`, `overlap=False`",
                    "dcp.async_save": "`dcp.async_save` (its staging)"}[m]
            out.append(f"| {name} | {b * 1e3:.2f} ms | {lo * 1e3:.2f}-{hi * 1e3:.2f} ms | "
                       f"{100 * b / step:.1f}% | {big['median_s'][m] * 1e3:.1f} ms |")
        out.append("")
    return out


def example_runs(runs: int) -> list[str]:
    """The markdown of part 3."""
    workdir = tempfile.mkdtemp(prefix="snapshot-bench-")
    try:
        per_step: dict[int, list[float]] = {0: [], 1: []}
        for i in range(runs):
            for every in (0, 1):
                s = run_example(workdir, every, f"e{every}-{i}")
                per_step[every].append(s["elapsed_s"] / s["steps"])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    off, on = statistics.median(per_step[0]), statistics.median(per_step[1])
    ratios = sorted(b / a for a, b in zip(per_step[0], per_step[1]))
    return ["| train_ddp.py, 2 workers, elasticstore-run | step time (median of runs) | runs |",
            "|---|---:|---|",
            f"| snapshots only at disk checkpoints (--snapshot-every 0) | {off * 1e3:.3f} ms | "
            f"{', '.join(f'{x * 1e3:.3f}' for x in per_step[0])} |",
            f"| a snapshot every step (default) | {on * 1e3:.3f} ms | "
            f"{', '.join(f'{x * 1e3:.3f}' for x in per_step[1])} |", "",
            f"step time with a snapshot every step: {_pct(on / off - 1)} (medians), "
            f"{_pct(statistics.median(ratios) - 1)} (median of the pairs' ratios: "
            f"{', '.join(_pct(r - 1) for r in ratios)})"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--big-calls", type=int, default=20)
    p.add_argument("--steps", type=int, default=2400, help="the example's steps (part 2)")
    p.add_argument("--big-steps", type=int, default=124, help="the 100 MB state's steps")
    p.add_argument("--big-step", type=float, default=0.1, help="its step time (seconds)")
    p.add_argument("--runs", type=int, default=0, help="whole example runs per mode (part 3)")
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())

    md = ["| state | bytes | snapshot() median | p90 | restore from memory |",
          "|---|---:|---:|---:|---:|"]
    calls: dict[str, Any] = {}
    for name, state, n in (("train_ddp.py's", example_state(), a.calls),
                           ("100 MB", big_state(), a.big_calls)):
        r = calls[name] = time_snapshots(state, n, a.shm)
        md.append(f"| {name} | {r['bytes']:,} | {r['median_s'] * 1e3:.3f} ms | "
                  f"{r['p90_s'] * 1e3:.3f} ms | {r['restore_s'] * 1e3:.1f} ms |")
    print("\n".join(md), flush=True)
    ex = snapshot_steps.run_example(a.steps, a.shm)
    big = [snapshot_steps.run_big(a.big_steps, a.big_step, a.shm, work=w)
           for w in ("sleep", "compute")]
    part2 = steps_tables(ex, big)
    print("\n" + "\n".join(part2), flush=True)
    md += [""] + part2
    if a.runs > 0:
        part3 = example_runs(a.runs)
        print("\n" + "\n".join(part3), flush=True)
        md += [""] + part3
    load_after = os.getloadavg()
    info = machine()
    head = (f"`python benchmarks/snapshot.py`, {started}; {info['cores']} cores, {info['cpu']}, "
            f"{info['kernel']}, Python {info['python']}, torch {torch.__version__}; load average "
            f"(1, 5, 15 min) {', '.join(f'{x:.1f}' for x in load_before)} before, "
            f"{', '.join(f'{x:.1f}' for x in load_after)} after.")
    if a.out:
        with open(f"{a.out}.json", "w") as f:
            json.dump({"started": started, "machine": info, "torch": torch.__version__,
                       "load_before": load_before, "load_after": load_after, "calls": calls,
                       "example_steps": ex, "big_steps": big}, f, indent=1)
        with open(f"{a.out}.md", "w") as f:
            f.write("# Snapshot cost\n\n" + head + "\n\n" + "\n".join(md) + "\n")
    print("\n" + head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
