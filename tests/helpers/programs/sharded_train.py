"""Sharded and per-rank state in snapshots, for ``tests/train/test_train_sharded_snapshots.py``
(gloo, env://; under elasticstore-run or started by the test with RANK/WORLD_SIZE/LOCAL_RANK).

``--mode fsdp``: a model sharded with FSDP2 (``fully_shard`` on a CPU mesh); ``snapshot`` of its
state dict (DTensors) is taken as sharded state (each rank its shards); then the full state dict
(every rank the same) is snapshotted, restored without a template and loaded back. ``--mode take``: per-rank state
(``replicated=False``) snapshotted at steps 1..3, then restored. ``--mode restore``: restored.
Each rank writes ``<mode>-<rank>.json`` in ``--dir``.
"""

import argparse
import faulthandler
import json
import os
import traceback
from typing import Any


def main() -> None:
    faulthandler.enable()  # an abort (seen once at exit: 'terminate called') shows every thread's stack
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--mode", choices=["fsdp", "take", "restore"], required=True)
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    from elasticstore.train import Snapshots

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    snap_dir = os.environ.get("ELASTICSTORE_SNAPSHOT_DIR")
    record: dict[str, Any] = {"rank": rank, "world": world}
    if args.mode == "fsdp":
        from torch import nn
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict,
                                                             set_model_state_dict)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        full = StateDictOptions(full_state_dict=True)
        with Snapshots() as snaps:
            try:
                snaps.snapshot({"model": model.state_dict(), "step": 1}, 1)
                record["sharded"] = "accepted"
            except Exception as err:  # noqa: BLE001 - recorded for the test
                record["sharded"] = f"{type(err).__name__}: {err}"
            record["area_after_sharded"] = sorted(os.listdir(snap_dir)) if snap_dir else None
            full_sd: Any = get_model_state_dict(model, options=full)
            want = {k: v.clone() for k, v in full_sd.items()}
            snaps.snapshot({"model": want, "step": 2}, 2)
            with torch.no_grad():
                for param in model.parameters():
                    param.zero_()
            restored = snaps.restore()
            assert restored is not None
            set_model_state_dict(model, restored.state["model"], options=full)
            back: Any = get_model_state_dict(model, options=full)
            record["restored"] = (restored.step, restored.source)
            record["exact"] = all(torch.equal(back[k], v) for k, v in want.items())
    else:
        with Snapshots(replicated=False) as snaps:
            if args.mode == "take":
                for step in (1, 2, 3):
                    snaps.snapshot({"rank": rank, "shard": torch.full((4,), float(rank))}, step)
            try:
                restored = snaps.restore()
                record["got"] = None if restored is None else {
                    "step": restored.step, "source": restored.source,
                    "rank": restored.state["rank"]}
            except Exception as err:  # noqa: BLE001 - recorded for the test
                record["error"] = f"{type(err).__name__}: {err}"
                record["trace"] = traceback.format_exc()[-2000:]
    with open(os.path.join(args.dir, f"{args.mode}-{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
