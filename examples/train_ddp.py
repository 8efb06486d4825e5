"""DDP on CPU (gloo) with the elastic sampler, in-memory snapshots and atomic checkpoints, on
synthetic data.

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --summary /tmp/run.json
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/train_ddp.py \\
        --fail-at-step 25 --fail-rank 1          # one rank fails once; the group resumes
    python examples/train_ddp.py                 # one process, no launcher

Reads the launcher's environment only (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT,
TORCHELASTIC_RESTART_COUNT), so it runs unchanged under torchrun and elasticstore-run. Everything
is a function of --seed: a run interrupted and resumed from its checkpoints ends with the same
weights as an uninterrupted one at the same world size (the sampler replays the same order from
the restored position; the model and optimizer state come from the restored state; nothing else
draws random numbers). Every step's state goes to an in-memory snapshot (``Snapshots``: under
elasticstore-run, the agent's shared memory, so a restarted group resumes from the newest step;
elsewhere the process's own memory), and every --checkpoint-every steps a disk checkpoint is
written from it in the background. With --summary, rank 0 writes a JSON summary (final loss, a SHA-256 of the
final weights, per-epoch sample counts and index sums) for comparing runs. With --events, ranks
append timestamped JSON lines to a file (a rank failing on purpose, rank 0's first step of every
start): scripts/demo measures the recovery time with them.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from elasticstore.train import ElasticDistributedSampler, Snapshots, heartbeat


class SyntheticRegression(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """``size`` samples ``(index, x, y)`` with y a fixed noisy nonlinear function of x."""

    def __init__(self, size: int, dim: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, dim, generator=g)
        w = torch.randn(dim, 1, generator=g)
        self.y = torch.tanh(self.x @ w) + 0.05 * torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--dataset-size", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank")
    p.add_argument("--checkpoint-dir", default="checkpoints/train_ddp")
    p.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    p.add_argument("--snapshot-every", type=int, default=1,
                   help="steps between in-memory snapshots (0: only at disk checkpoints)")
    p.add_argument("--node-local", action="store_true",
                   help="checkpoint directories are per node: local rank 0 of every node saves")
    p.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    p.add_argument("--fail-at-step", type=int, default=-1,
                   help="make --fail-rank exit when it reaches this step (first attempt only)")
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--summary", default=None, help="rank 0 writes a JSON summary here")
    p.add_argument("--events", default=None,
                   help="append timestamped JSON lines here: 'fail' (the rank failing on purpose), "
                        "'first_step' (rank 0, after the first step of every start)")
    p.add_argument("--step-time", type=float, default=0.0,
                   help="sleep so that a step takes at least this long (seconds): to watch a run "
                        "or to act on it mid-run")
    args = p.parse_args(argv)
    for name in ("epochs", "dataset_size", "batch_size", "checkpoint_every", "log_every", "keep"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be >= 1")
    if args.snapshot_every < 0:
        p.error("argument --snapshot-every: must be >= 0")
    return args


def init_group(restart: int) -> None:
    timeout = timedelta(seconds=60)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # a launcher's env:// variables
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        # torchrun (2.13, agent store) gives every restart the same store with no prefix of its
        # own: without one, a restarted rank can read the previous round's gloo addresses and
        # fail to connect ("Connection refused") or hang.
        store = dist.PrefixStore(f"train_ddp/restart_{restart}", store)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    else:  # one process, no launcher
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def allreduce_per_parameter(group, bucket):  # type: ignore[no-untyped-def]
    """DDP communication hook: averages each parameter's gradient on its own. DDP's default
    all-reduces a whole bucket, and the first step after every (re)start uses a different bucket
    layout than the later ones (DDP rebuilds its buckets in gradient-ready order after one step);
    with more than two ranks the layout changes the order of the sums, so a resumed run would end
    a few ULPs away from an uninterrupted one. Per parameter, the order never depends on it.
    (No annotations: DDP checks them, and this module's are strings.)"""
    world = dist.get_world_size(group)
    works = [dist.all_reduce(g, group=group, async_op=True) for g in bucket.gradients()]
    for work in works:
        work.wait()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer().div_(world))  # gradients() are views of buffer()
    return fut


def record_event(path: str | None, event: str, **fields: Any) -> None:
    """Appends one JSON line (one write on an O_APPEND file: lines of several ranks never mix)."""
    if path:
        line = json.dumps({"event": event, "time": time.time(), **fields}) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def build_model(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its optimizer, the same initial weights on every rank (seeded)."""
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(args.dim, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1))
    return model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


def weights_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_group(restart)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    saver = local_rank == 0 if args.node_local else rank == 0

    dataset = SyntheticRegression(args.dataset_size, args.dim, args.seed)
    model, optimizer = build_model(args)
    sampler = ElasticDistributedSampler(dataset, seed=args.seed)
    step = 0
    last_loss = torch.zeros(1)  # this rank's loss of its latest step
    # Per epoch, over every rank: samples trained on, sum of their indices, sum of squares.
    epoch_stats: dict[str, list[float]] = {}

    snaps = Snapshots(every=args.snapshot_every, checkpoint_dir=args.checkpoint_dir,
                      checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep,
                      write_checkpoints=saver)
    restored = snaps.restore()
    if restored is not None:
        model.load_state_dict(restored.state["model"])
        optimizer.load_state_dict(restored.state["optimizer"])
        sampler.load_state_dict(restored.state["sampler"])
        epoch_stats = restored.state["epoch_stats"]
        last_loss = restored.state["last_loss"]
        step = restored.step
        if rank == 0:
            print(f"resumed from step {step} (epoch {sampler.epoch}, "
                  f"{sampler.samples_consumed} samples consumed) at world size {world}, from "
                  f"{restored.source}", flush=True)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, allreduce_per_parameter)  # resumes bit for bit
    loss_fn = nn.MSELoss()
    pending = torch.zeros(3, dtype=torch.float64)  # this rank's stats since the last flush

    def add(epoch: int) -> None:  # ``pending`` (summed over the ranks) into the epoch's totals
        totals = epoch_stats.setdefault(str(epoch), [0.0, 0.0, 0.0])
        for i in range(3):
            totals[i] += float(pending[i])
        pending.zero_()

    def flush(epoch: int) -> None:
        dist.all_reduce(pending)
        add(epoch)

    started = time.monotonic()
    mark, mark_step = started, step
    samples_this_run = 0
    for epoch in range(sampler.epoch, args.epochs):
        sampler.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                            num_workers=args.workers)
        for index, x, y in loader:
            step_started = time.monotonic()
            if step + 1 == args.fail_at_step and rank == args.fail_rank and restart == 0:
                print(f"rank {rank}: failing on purpose at step {step + 1}", file=sys.stderr,
                      flush=True)
                record_event(args.events, "fail", rank=rank, step=step + 1, restart=restart)
                os._exit(3)
            idx = index.to(torch.float64)
            pending += torch.stack([torch.tensor(float(len(idx)), dtype=torch.float64),
                                    idx.sum(), (idx * idx).sum()])
            # A snapshot holds the epoch's totals over every rank up to its step: their
            # all_reduce starts now and runs while the step computes.
            totals = dist.all_reduce(pending, async_op=True) if snaps.due(step + 1) else None
            optimizer.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            optimizer.step()
            sampler.advance(len(index))
            step += 1
            samples_this_run += len(index) * world
            if totals is not None:
                totals.wait()
                add(epoch)
            last_loss = loss.detach().reshape(1)
            if rank == 0 and samples_this_run == len(index) * world:  # this start's first step
                record_event(args.events, "first_step", step=step, world=world, restart=restart)
            if args.step_time > 0:
                time.sleep(max(0.0, args.step_time - (time.monotonic() - step_started)))
            if step % args.log_every == 0:
                avg = last_loss.clone()
                dist.all_reduce(avg)
                if rank == 0:
                    now = time.monotonic()
                    rate = (step - mark_step) * args.batch_size * world / max(now - mark, 1e-9)
                    mark, mark_step = now, step
                    print(f"epoch {epoch} step {step} loss {avg.item() / world:.6f} "
                          f"samples/s {rate:.0f} world {world} restart {restart}", flush=True)
            if totals is not None:  # due(step): the disk checkpoints' steps included
                snaps.snapshot({
                    "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "sampler": sampler.state_dict(), "epoch_stats": epoch_stats,
                    "last_loss": last_loss,
                }, step)
            heartbeat()  # elasticstore-run --heartbeat-timeout: a rank silent too long is a hang
        flush(epoch)
    snaps.close()  # waits for the disk checkpoint being written

    final = last_loss.clone()
    dist.all_reduce(final)
    elapsed = time.monotonic() - started
    if rank == 0:
        summary: dict[str, Any] = {
            "final_loss": final.item() / world,
            "weights_sha256": weights_sha256(model),
            "steps": step,
            "world_size": world,
            "restart_count": restart,
            "epoch_stats": epoch_stats,
            "elapsed_s": elapsed,
            "samples_per_s": samples_this_run / max(elapsed, 1e-9),
        }
        print(f"done: {step} steps, final loss {summary['final_loss']:.6f}, "
              f"weights {summary['weights_sha256'][:16]}, {summary['samples_per_s']:.0f} samples/s",
              flush=True)
        if args.summary:
            tmp = f"{args.summary}.tmp"
            with open(tmp, "w") as f:
                json.dump(summary, f, indent=1)
            os.replace(tmp, args.summary)
    # DDP goes before the group. torch frees DDP's reducer with the GIL held; if that drops the
    # last reference to a gloo group, the group's destructor joins its worker threads, and one may
    # be waiting for the GIL to free a finished collective's tensors: a hang at exit (torch issue
    # 56297). Freed here, the reducer drops one reference; the group goes in destroy_process_group.
    del ddp
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
