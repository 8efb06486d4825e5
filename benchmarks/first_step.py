"""Launch -> the first training step, ``elasticstore-run`` against torchrun, same script, same run.

What a user waits for when a job starts: ``examples/train_ddp.py`` (DDP, gloo, the elastic
sampler and in-memory snapshots) with 2 workers on one node (``--standalone``), from the
launcher's start to rank 0's first step (the example's ``--events`` line ``first_step``, its
wall-clock time). Both launchers at their defaults; the runs alternate (elasticstore-run,
torchrun, elasticstore-run, ...) so that a change in the machine's load hits both. Each process a
run starts is in its own session, killed with it if the run overruns, and checked gone.

    python benchmarks/first_step.py [--runs 5] [--out benchmarks/results/first_step]

Writes ``OUT.json`` (every sample) and ``OUT.md`` (min, median, max per launcher; the ratio of
the medians).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_ddp.py")
LAUNCHERS = ("elasticstore-run", "torchrun")
LIMIT_S = 120.0  # one run, start to end


def _bin(name: str) -> str:
    """The console script beside this interpreter (a venv's), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if os.path.exists(beside) else name


def one_run(launcher: str) -> float:
    """Seconds from the launcher's start to rank 0's first step."""
    with tempfile.TemporaryDirectory(prefix="es-first-step-") as tmp:
        events = os.path.join(tmp, "events.jsonl")
        head = [_bin("elasticstore-run")] if launcher == "elasticstore-run" else \
            [sys.executable, "-m", "torch.distributed.run"]
        cmd = [*head, "--standalone", "--nproc-per-node", "2", EXAMPLE, "--epochs", "1",
               "--dataset-size", "512", "--checkpoint-dir", os.path.join(tmp, "ckpt"),
               "--events", events]
        start = time.time()
        proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            _, err = proc.communicate(timeout=LIMIT_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        _check_gone(proc.pid)
        if proc.returncode != 0:
            raise RuntimeError(f"{launcher} exited {proc.returncode}: {err.decode()[-6000:]}")
        with open(events) as f:
            first = [json.loads(line) for line in f if '"first_step"' in line]
        if not first:
            raise RuntimeError(f"{launcher}: no first step recorded")
        return float(first[0]["time"]) - start


def _check_gone(pgid: int) -> None:
    """Kills and names what is left of the run's session (nothing should be)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return
    os.killpg(pgid, signal.SIGKILL)
    raise RuntimeError(f"processes of session {pgid} outlived their launcher")


def render(samples: dict[str, list[float]], when: str) -> str:
    med = {k: statistics.median(v) for k, v in samples.items()}
    lines = [f"Launch -> rank 0's first training step, `examples/train_ddp.py`, 2 gloo workers, "
             f"`--standalone`, defaults; runs alternated ({when}).", "",
             "| launcher | runs | min | median | max | median vs torchrun |", "|---|---|---|---|---|---|"]
    for name, values in samples.items():
        lines.append(f"| {name} | {len(values)} | {min(values):.2f} s | {med[name]:.2f} s | "
                     f"{max(values):.2f} s | {med[name] / med['torchrun']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5, help="runs per launcher")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "first_step"))
    args = p.parse_args()
    samples: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    for _ in range(args.runs):
        for name in LAUNCHERS:
            samples[name].append(one_run(name))
            print(f"{name}: {samples[name][-1]:.3f} s", flush=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with open(args.out + ".json", "w") as f:
        json.dump({"when": when, "samples": samples}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(render(samples, when))
    print(render(samples, when))


if __name__ == "__main__":
    main()
