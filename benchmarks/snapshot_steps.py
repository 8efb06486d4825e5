"""Steps with and without a snapshot, interleaved in one run (``benchmarks/snapshot.py`` prints
the tables): on this shared machine the load changes between runs far more than between
neighbouring steps, so every mode runs in short blocks, in turn, in the same processes.

- ``example``: ``examples/train_ddp.py``'s step (its model, DDP with its per-parameter hook, gloo,
  its DataLoader; 2 processes on loopback, one thread each), in blocks of ``BLOCK`` steps per
  mode: ``off`` (no snapshot), ``state dicts`` (the example's state built every step and dropped:
  what any checkpointing of each step pays first), ``snapshot`` (``Snapshots.snapshot`` of the
  example's state every step), ``example`` (what the example does: the epoch totals'
  ``all_reduce`` the snapshot holds, started before the step, plus the snapshot) and
  ``dcp.async_save`` (the same state, torch's defaults, no process group, each rank to a
  directory of its own under the snapshot file system: the call, which returns once the state is
  staged, in the step; its write waited for, and the ranks met in a barrier, outside it).
- ``big``: a 100 MB state (25 float32 parameters of 4 MB and plain objects) in one process, each
  step an optimizer step (``torch.optim.SGD``, gradients set once) and then a sleep up to
  ``step_s`` (the accelerator's time; the CPU is free), or (``work="compute"``) as many matrix
  products on this thread as took ``step_s`` before the run (a CPU-bound step: a copy beside it
  shows as a longer step); in turn per step: ``off``, ``snapshot`` (the default:
  the optimizer's tensors copied while the step goes on, waited for at the next optimizer step,
  and that wait counted as blocking), ``snapshot, overlap=False`` (every copy before ``snapshot``
  returns), and ``dcp.async_save`` (torch's defaults, no process group, to a directory under the
  snapshot file system), whose call returns once the state is staged (copied); its write is
  waited for after the step, outside the timed part.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_ddp.py")
BLOCK = 8
EXAMPLE_MODES = ("off", "state dicts", "snapshot", "example", "dcp.async_save")
COPY_MODES = ("snapshot", "example")  # the modes whose snapshot() times are kept
BIG_MODES = ("off", "snapshot", "snapshot, overlap=False", "dcp.async_save")


def _example_module() -> Any:
    spec = importlib.util.spec_from_file_location("train_ddp", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def example_model(ex: Any = None) -> tuple[Any, Any]:
    """The example's model and optimizer at its default sizes, built by the example itself."""
    ex = ex or _example_module()
    return ex.build_model(ex.parse_args([]))


def example_worker(rank: int, steps: int, snapdir: str, out: str) -> None:
    """One rank of the example's loop; rank 0 writes its per-step times to ``out``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from elasticstore.train import ElasticDistributedSampler, SnapshotSettings, Snapshots

    ex = _example_module()
    dist.init_process_group("gloo", init_method="env://")
    dataset = ex.SyntheticRegression(4096, 16, 0)
    model, optimizer = example_model(ex)
    sampler = ElasticDistributedSampler(dataset, seed=0)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, ex.allreduce_per_parameter)
    loss_fn = nn.MSELoss()
    snaps = Snapshots(every=1, settings=SnapshotSettings(snapdir, rank))
    pending = torch.zeros(3, dtype=torch.float64)
    epoch_stats: dict[str, list[float]] = {}
    times: dict[str, list[float]] = {m: [] for m in EXAMPLE_MODES}
    copies: list[float] = []
    staged: list[float] = []  # dcp.async_save's calls

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "sampler": sampler.state_dict(), "epoch_stats": epoch_stats,
                "last_loss": last_loss}

    step, epoch = 0, 0
    prev = time.perf_counter()  # a step: from the previous one's end (its batch loaded in it)
    while step < steps:
        sampler.set_epoch(epoch)
        for index, x, y in DataLoader(dataset, batch_size=32, sampler=sampler):
            mode = EXAMPLE_MODES[(step // BLOCK) % len(EXAMPLE_MODES)]
            idx = index.to(torch.float64)
            pending += torch.stack([torch.tensor(float(len(idx)), dtype=torch.float64),
                                    idx.sum(), (idx * idx).sum()])
            totals = dist.all_reduce(pending, async_op=True) if mode == "example" else None
            optimizer.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            optimizer.step()
            sampler.advance(len(index))
            step += 1
            if totals is not None:
                totals.wait()
                row = epoch_stats.setdefault(str(epoch), [0.0, 0.0, 0.0])
                for i in range(3):
                    row[i] += float(pending[i])
                pending.zero_()
            last_loss = loss.detach().reshape(1)
            future: Any = None
            ckpt = os.path.join(snapdir, f"dcp-{rank}-{step}")  # dcp.async_save's directory
            if mode == "state dicts":
                state()
            elif mode in COPY_MODES:
                snaps.snapshot(state, step)  # the state built inside the call: its time counts
                copies.append(snaps.last_copy_s)
            elif mode == "dcp.async_save":
                t0 = time.perf_counter()
                future = dcp.async_save(state(), checkpoint_id=ckpt, no_dist=True)
                staged.append(time.perf_counter() - t0)
            now = time.perf_counter()
            times[mode].append(now - prev)
            prev = now
            if future is not None:  # its write, then both ranks again, outside the step
                getattr(future, "upload_completion", future).result()
                shutil.rmtree(ckpt, ignore_errors=True)
                dist.barrier()
                prev = time.perf_counter()
            if step >= steps:
                break
        epoch += 1
    snaps.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "copies": copies, "staged": staged,
                       "bytes": snaps.last_bytes}, f)
    del ddp
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_example(steps: int, shm: str) -> dict[str, Any]:
    """The example's step in ``EXAMPLE_MODES``, 2 processes; medians in seconds."""
    r = run_two_ranks(lambda rank, work, out: [os.path.abspath(__file__), "example", str(rank),
                                               str(steps), work, out], "snapshot-steps-", shm, 600)
    out = summarize(r["times"], r["copies"], r["bytes"], warmup=2 * BLOCK * len(EXAMPLE_MODES))
    staged = sorted(r["staged"][2 * BLOCK:])
    out["staged_median_s"] = statistics.median(staged)
    out["staged_p90_s"] = staged[int(0.9 * (len(staged) - 1))]
    return out


def run_two_ranks(args: Callable[[int, str, str], list[str]], prefix: str, shm: str,
                  timeout: float) -> dict[str, Any]:
    """Runs ``python *args(rank, work, out)`` for ranks 0 and 1 (gloo through env://, one thread
    each, a fresh directory ``work`` under ``shm``) and returns what one of them wrote to ``out``
    (JSON); every process is ended and ``work`` removed before it returns."""
    work = tempfile.mkdtemp(dir=shm, prefix=prefix)
    out = os.path.join(work, "result.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(2):
            procs.append(subprocess.Popen([sys.executable, *args(rank, work, out)],
                                          env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank))))
        for proc in procs:
            if proc.wait(timeout=timeout) != 0:
                raise RuntimeError(f"a worker exited {proc.returncode}")
        with open(out) as f:
            r: dict[str, Any] = json.load(f)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    return r


def summarize(times: dict[str, list[float]], copies: list[float], size: int,
              warmup: int) -> dict[str, Any]:
    """Per mode after the first ``warmup`` steps (the buffers are made then), without the first
    step of each block (it pays for the mode before it, e.g. caches left cold by a DCP write): the
    median step, and the median over the cycles (one block of every mode) of the block's median
    over the ``off`` block's of the same cycle (the load drifts less within a cycle than over the
    run)."""
    skip, kept = warmup // len(times), BLOCK - 1
    per = {m: [x for i, x in enumerate(t[skip:]) if i % BLOCK] for m, t in times.items()}
    med = {m: statistics.median(t) for m, t in per.items()}
    cycles = min(len(t) for t in per.values()) // kept

    def block(m: str, c: int) -> float:
        return statistics.median(per[m][c * kept:(c + 1) * kept])

    ratio = {m: statistics.median(block(m, c) / block("off", c) for c in range(cycles))
             for m in per}
    copies = sorted(copies[skip * len(COPY_MODES):])
    return {"median_s": med, "paired_ratio": ratio, "steps": {m: len(t) for m, t in per.items()},
            "cycles": cycles, "copy_median_s": statistics.median(copies),
            "copy_p90_s": copies[int(0.9 * (len(copies) - 1))], "bytes": size}


def run_big(steps: int, step_s: float, shm: str, mb: int = 100,
            work: str = "sleep") -> dict[str, Any]:
    """A ``mb`` MB state, steps of ``step_s`` (``work``: "sleep" or "compute"), in ``BIG_MODES``
    per step in turn (one process)."""
    import torch.distributed.checkpoint as dcp

    from elasticstore.train import SnapshotSettings, Snapshots
    from elasticstore.train.snapshots.copying import copy_threads

    params = [torch.nn.Parameter(torch.randn(1024, 1024)) for _ in range(mb // 4)]
    for p in params:
        p.grad = torch.full_like(p, 1e-6)
    optim = torch.optim.SGD(params, lr=1.0)
    state: dict[str, Any] = {
        "model": {f"layer{i}.weight": p.detach() for i, p in enumerate(params)},
        "step": 0, "sampler": {"epoch": 0, "samples_consumed": 0}, "note": "x" * 100}
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    t0 = time.perf_counter()
    for _ in range(50):
        torch.mm(a, b)
    reps = max(1, int(step_s / ((time.perf_counter() - t0) / 50)))  # a fixed work per step
    work_dir = tempfile.mkdtemp(dir=shm, prefix="snapshot-big-")
    overlapped = Snapshots(every=1, settings=SnapshotSettings(work_dir, 0))
    blocking = Snapshots(every=1, settings=SnapshotSettings(work_dir, 1), overlap=False)
    times: dict[str, list[float]] = {m: [] for m in BIG_MODES}
    blocked: dict[str, list[float]] = {m: [] for m in BIG_MODES}
    previous = ""
    try:
        for step in range(1, steps + 1):
            mode = BIG_MODES[step % len(BIG_MODES)]
            started = time.perf_counter()
            overlapped.last_wait_s = 0.0
            optim.step()  # waits for the overlapped copy of the step before, if it runs
            if previous == "snapshot":
                blocked["snapshot"][-1] += overlapped.last_wait_s
            state["step"] = step
            t0 = time.perf_counter()
            future: Any = None  # a Future, or an AsyncSaveResponse with asynchronous staging
            if mode == "snapshot":
                overlapped.snapshot(state, step)
            elif mode == "snapshot, overlap=False":
                blocking.snapshot(state, step)
            elif mode == "dcp.async_save":
                future = dcp.async_save(state, checkpoint_id=os.path.join(work_dir, f"dcp-{step}"),
                                        no_dist=True)
            blocked[mode].append(time.perf_counter() - t0)
            if work == "compute":  # a fixed amount: a copy beside it shows as a longer step
                for _ in range(reps):
                    torch.mm(a, b)
            else:
                time.sleep(max(0.0, step_s - (time.perf_counter() - started)))
            times[mode].append(time.perf_counter() - started)
            previous = mode
            if future is not None:  # its write, outside the step
                getattr(future, "upload_completion", future).result()
                shutil.rmtree(os.path.join(work_dir, f"dcp-{step}"), ignore_errors=True)
        size = overlapped.last_bytes
        overlapped.close()
        blocking.close()
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return {"step_s": step_s, "work": work, "copy_threads": copy_threads(),
            "median_s": {m: statistics.median(t[3:]) for m, t in times.items()},
            "blocked_median_s": {m: statistics.median(t[3:]) for m, t in blocked.items()},
            "blocked_range_s": {m: (min(t[3:]), max(t[3:])) for m, t in blocked.items()},
            "steps": {m: len(t) - 3 for m, t in times.items()}, "bytes": size}


if __name__ == "__main__":
    if sys.argv[1] == "example":
        torch.set_num_threads(1)
        example_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
