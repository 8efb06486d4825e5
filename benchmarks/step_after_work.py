"""How much a small training step slows down after work done between steps: the example's model
(``examples/train_ddp.py``'s, one process, one thread, SGD with momentum) trained in blocks of
``BLOCK`` steps per mode, modes in turn; after each step a mode does one thing (a snapshot of the
example's state, or work of about its size without one), timed apart from the step.

What it shows: the step's own part (forward, backward, optimizer) grows after any Python work of
a few hundred microseconds (caches and branch predictors the work displaced), so a snapshot of
a tiny state costs more than its blocking time (``docs/training.md``, Snapshots).

    python benchmarks/step_after_work.py [--cycles 400]
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from elasticstore.train import SnapshotSettings, Snapshots
from snapshot_steps import example_model

BLOCK = 8


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=400, help="blocks per mode")
    p.add_argument("--shm", default="/dev/shm")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model, optimizer = example_model()
    x, y = torch.randn(32, 16), torch.randn(32, 1)
    work = tempfile.mkdtemp(dir=a.shm, prefix="step-after-work-")
    snaps = Snapshots(every=1, settings=SnapshotSettings(work, 0))
    probe = os.path.join(work, "probe")
    counter = iter(range(1, 1 << 40))

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "sampler": {"epoch": 0, "consumed": 5, "seed": 0}, "epoch_stats": {"0": [1.0]},
                "last_loss": torch.zeros(1)}

    def renames() -> None:
        open(probe, "w").close()
        os.rename(probe, probe + ".x")
        os.rename(probe + ".x", probe)

    modes: dict[str, Callable[[], Any]] = {
        "nothing": lambda: None,
        "`snapshot()`": lambda: snaps.snapshot(state, next(counter)),
        "the state dicts built": state,
        "`pickle.dumps` of the state": lambda: pickle.dumps(state()),
        "a file created, renamed twice": renames,
        "3 `os.access` calls": lambda: [os.access(probe, os.F_OK) for _ in range(3)],
    }
    train: dict[str, list[float]] = {m: [] for m in modes}
    extra: dict[str, list[float]] = {m: [] for m in modes}
    clock = time.perf_counter
    try:
        for cycle in range(a.cycles):
            for mode, do in modes.items():
                for i in range(BLOCK):
                    t0 = clock()
                    optimizer.zero_grad()
                    nn.functional.mse_loss(model(x), y).backward()
                    optimizer.step()
                    t1 = clock()
                    do()
                    t2 = clock()
                    if cycle >= a.cycles // 20 and i:  # warm-up; a block's first step
                        train[mode].append(t1 - t0)
                        extra[mode].append(t2 - t1)
        snaps.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(train["nothing"])
    print("| after each step | the step's own part (median) | vs nothing | the work (median) |")
    print("|---|---:|---:|---:|")
    for mode in modes:
        t, e = statistics.median(train[mode]), statistics.median(extra[mode])
        print(f"| {mode} | {t * 1e6:.0f} us | {100 * (t / base - 1):+.0f}% | {e * 1e6:.0f} us |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
