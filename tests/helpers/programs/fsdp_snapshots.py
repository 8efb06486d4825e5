"""FSDP2 training with sharded snapshots, for ``tests/train/test_train_fsdp_snapshots.py`` (gloo,
env://; under elasticstore-run or started by the test with RANK/WORLD_SIZE/LOCAL_RANK).

Every run first restores (``Snapshots.restore(template=...)``) and writes what it got to
``restored-<attempt>-<world>.json`` (with every rank's source) and the full state it holds then (every DTensor's
``full_tensor()``) to ``restored-<attempt>-<world>.pt``; then trains to ``--steps``, snapshotting
every step and writing the full state before each step's snapshot to ``full-<step>.pt`` (rank 0).
``--kill-rank R --kill-at K``: rank R SIGKILLs itself in the first attempt after step K's
snapshot. ``--ckpt DIR``: disk checkpoints (DCP) every ``--ckpt-every`` steps. ``--step-time S``:
each step sleeps S seconds more (a test's time to act between steps). ``--ballast-mb M``: the
state also holds ``extra.ballast``, a DTensor of M MB sharded by rows whose every value is a
function of the step and the row (``ballast_value``): a large state that costs no all-gather per
step; it is left out of the ``.pt`` files, and the restored one is checked against the step it
came from (``ballast_ok`` in the json, per rank). ``--steps-after-restore N``: a run that
restored a step trains N steps past it (not to ``--steps``). ``--hidden H``: the hidden layer's
width (default 14); wide enough, each rank's shards and AdamW's state pass 4 MiB and the
snapshot's copy overlaps the next step (``train/snapshots/overlap.py``).
"""

import argparse
import faulthandler
import json
import os
import signal
import time
from typing import Any


def full_state(state: Any) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor

    flat, _ = flatten_state_dict(state)
    out = {}
    for k in sorted(flat):
        if k.endswith("ballast"):
            continue  # checked against ballast_value instead
        v = flat[k]
        if isinstance(v, DTensor):
            v = v.full_tensor()
        out[k] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def ballast_value(local: Any, step: int, first_row: int) -> Any:
    """What the ballast's rows ``first_row ..`` hold at ``step`` (exact in float32)."""
    import torch

    rows = torch.arange(first_row, first_row + local.shape[0], dtype=torch.float32) % 8
    return (rows + 8.0 * step)[:, None].expand(local.shape)


def main() -> None:
    faulthandler.enable()  # an abort (seen once at exit: 'terminate called') shows every thread's stack
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--ckpt-every", type=int, default=1)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--ballast-mb", type=int, default=0)
    p.add_argument("--steps-after-restore", type=int, default=-1)
    p.add_argument("--hidden", type=int, default=14)
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elasticstore.train import Snapshots

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    hidden = args.hidden  # 14: uneven shards; wide: a state whose copy overlaps the next step
    model = nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, 3))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    rows = args.ballast_mb * 256  # 1024 float32 a row: 256 rows a MB (divisible by 2 and 4)
    ballast = torch.zeros(rows // world, 1024)

    def state() -> dict[str, Any]:
        msd, osd = get_state_dict(model, optim)
        extra: dict[str, Any] = {"note": "x", "steps_seen": step}
        if rows:
            from torch.distributed.tensor import DTensor, Shard

            extra["ballast"] = DTensor.from_local(ballast, mesh, [Shard(0)], run_check=False)
        return {"model": msd, "optim": osd, "extra": extra}

    step = 0
    snaps = Snapshots(every=1, checkpoint_dir=args.ckpt, checkpoint_every=args.ckpt_every,
                      keep_checkpoints=2)
    template = state()
    restored = snaps.restore(template=template)
    if restored is not None:
        set_state_dict(model, optim, model_state_dict=template["model"],
                       optim_state_dict=template["optim"])
        step = restored.step
    full = full_state(state())
    sources: list[Any] = [None] * world
    dist.all_gather_object(sources, None if restored is None else restored.source)
    ballast_ok: list[Any] = [None] * world
    dist.all_gather_object(ballast_ok, bool(torch.equal(
        ballast, ballast_value(ballast, step, rank * ballast.shape[0]))) if rows else None)
    if rank == 0:
        tag = f"restored-{attempt}-{world}"
        torch.save(full, os.path.join(args.dir, f"{tag}.pt"))
        with open(os.path.join(args.dir, f"{tag}.json"), "w") as f:
            json.dump(None if restored is None else {
                "step": restored.step, "source": restored.source, "sources": sources,
                "ballast_ok": ballast_ok,
                "extra": {k: v for k, v in template["extra"].items() if k != "ballast"}}, f)
    end = args.steps
    if restored is not None and args.steps_after_restore >= 0:
        end = step + args.steps_after_restore
    while step < end:
        step += 1
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(8, 10, generator=g)
        loss = model(x).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rows:
            ballast.copy_(ballast_value(ballast, step, rank * ballast.shape[0]))
        time.sleep(args.step_time)
        # the reference before the snapshot: a step that commits always has its full-<step>.pt
        # (rank 0 takes part in every commit), even when its node dies right after
        full = full_state(state())
        if rank == 0:
            part = os.path.join(args.dir, f".tmp-full-{step}.pt")  # whole or absent
            torch.save(full, part)
            os.replace(part, os.path.join(args.dir, f"full-{step}.pt"))
        snaps.snapshot(state, step)
        if attempt == 0 and step == args.kill_at:
            dist.barrier()  # full-<step>.pt is written before the kill
            if rank == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
    snaps.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
