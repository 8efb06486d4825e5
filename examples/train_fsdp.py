"""FSDP2 (``fully_shard``) on CPU (gloo) with the elastic sampler and sharded in-memory snapshots
every step, on synthetic data.

    elasticstore-run --standalone --nproc-per-node 2 examples/train_fsdp.py
    elasticstore-run --standalone --nproc-per-node 2 --max-restarts 1 examples/train_fsdp.py \\
        --fail-at-step 25 --fail-rank 1        # one rank fails once; the group resumes
    torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py   # disk (DCP) resume only

Reads the launcher's environment only, so it runs unchanged under torchrun and elasticstore-run.
Every step each rank snapshots its shards of the model and optimizer (``Snapshots``: under
elasticstore-run in the agent's shared memory) and every --checkpoint-every steps the ranks write
a DCP checkpoint from the snapshot in the background, each its own shard. A restarted group, or a
new job with the same --checkpoint-dir at any world size, resumes with ``restore(template=...)``:
the state is loaded into the run's own state dict, resharded to the current world size; rank 0
prints where every rank's state came from (memory: its node's snapshots or the replica of another
node's held there; peer: another rank's memory; disk: the DCP checkpoint). With --summary, rank 0
writes a JSON summary (final loss, a SHA-256 of the final full model state, steps, world size);
with --events, rank 0 appends timestamped JSON lines to a file ('start': the step it starts from
and every rank's restore source; 'step': every --log-every steps) for measuring what a failure
cost.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from elasticstore.train import ElasticDistributedSampler, Snapshots


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--dataset-size", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default="checkpoints/train_fsdp")
    p.add_argument("--checkpoint-every", type=int, default=20, help="steps between DCP checkpoints")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--fail-at-step", type=int, default=-1,
                   help="make --fail-rank exit when it reaches this step (first attempt only)")
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--summary", default=None, help="rank 0 writes a JSON summary here")
    p.add_argument("--events", default=None,
                   help="rank 0 appends timestamped JSON lines here: 'start' (the step it starts "
                        "from, every rank's restore source), 'step' (every --log-every steps)")
    p.add_argument("--step-time", type=float, default=0.0,
                   help="sleep so that a step takes at least this long (seconds): to watch a run "
                        "or to act on it mid-run")
    args = p.parse_args(argv)
    for name in ("epochs", "dataset_size", "batch_size", "checkpoint_every", "keep", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be >= 1")
    if args.step_time < 0:
        p.error("argument --step-time: must be >= 0")
    return args


def init_group(restart: int) -> None:
    timeout = timedelta(seconds=60)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore(f"train_fsdp/restart_{restart}", store)  # see train_ddp.py
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def record_event(path: str | None, event: str, **fields: Any) -> None:
    """Appends one JSON line (one write on an O_APPEND file: lines of several nodes never mix)."""
    if path:
        line = json.dumps({"event": event, "time": time.time(), **fields}) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def full_state_sha256(model: nn.Module) -> str | None:
    """A SHA-256 of the whole (unsharded) model state on rank 0, None elsewhere: a collective."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    h = hashlib.sha256()
    for name, tensor in full.items():
        assert isinstance(tensor, torch.Tensor), name
        h.update(name.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_group(restart)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.dataset_size, args.dim, generator=g)
    y = torch.tanh(x @ torch.randn(args.dim, 1, generator=g))
    dataset = TensorDataset(x, y)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(args.dim, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sampler = ElasticDistributedSampler(dataset, seed=args.seed)
    step = 0

    def state() -> dict[str, Any]:
        msd, osd = get_state_dict(model, optimizer)
        return {"model": msd, "optim": osd, "sampler": sampler.state_dict()}

    snaps = Snapshots(every=1, checkpoint_dir=args.checkpoint_dir,
                      checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep)
    template = state()
    restored = snaps.restore(template=template)  # loads into template, resharded
    if restored is not None:
        set_state_dict(model, optimizer, model_state_dict=template["model"],
                       optim_state_dict=template["optim"])
        sampler.load_state_dict(template["sampler"])
        step = restored.step
    sources: list[Any] = [None] * world  # every rank's restore source (None: nothing restored)
    dist.all_gather_object(sources, None if restored is None else restored.source)
    if rank == 0 and restored is not None:
        print(f"resumed from step {step} at world size {world}, from {restored.source} "
              f"(by rank: {' '.join(sources)}; restart {restart})", flush=True)
    if rank == 0:
        record_event(args.events, "start", step=step, world=world, sources=sources,
                     restart=restart)
    started = time.monotonic()
    first_step = step
    last_loss = torch.zeros(1)
    for epoch in range(sampler.epoch, args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in DataLoader(dataset, batch_size=args.batch_size, sampler=sampler):
            step_started = time.monotonic()
            step += 1
            sampler.advance(len(xb))
            loss = nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            last_loss = loss.detach().reshape(1)
            snaps.snapshot(state, step)
            if restart == 0 and step == args.fail_at_step and rank == args.fail_rank:
                print(f"rank {rank} failing at step {step} on purpose", flush=True)
                os._exit(1)
            if args.step_time > 0:
                time.sleep(max(0.0, args.step_time - (time.monotonic() - step_started)))
            if rank == 0 and step % args.log_every == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} (snapshot "
                      f"{snaps.last_copy_s * 1e3:.2f} ms)", flush=True)
                record_event(args.events, "step", step=step, world=world, restart=restart)
    snaps.close()
    final = last_loss.clone()
    dist.all_reduce(final)
    digest = full_state_sha256(model)
    elapsed = time.monotonic() - started
    if rank == 0:
        summary = {"final_loss": final.item() / world, "weights_sha256": digest, "steps": step,
                   "world_size": world, "restart_count": restart, "elapsed_s": elapsed,
                   "steps_this_run": step - first_step}
        print(f"done: {step} steps, final loss {summary['final_loss']:.6f}, "
              f"weights {str(digest)[:16]}", flush=True)
        if args.summary:
            tmp = f"{args.summary}.tmp"
            with open(tmp, "w") as f:
                json.dump(summary, f, indent=1)
            os.replace(tmp, args.summary)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
