"""What a worker's training helpers import: a replicated state (DDP's) is snapshotted and
checkpointed without ``torch.distributed.checkpoint`` or ``torch.distributed.tensor`` (about 1 s
of every worker's first start here); sharded tensors are still found, and refused or taken as
sharded state, once the code that makes them has imported their module, even after earlier calls
ran without it. A fresh interpreter each (this process has both modules loaded already)."""

from __future__ import annotations

import json
import subprocess
import sys

PROGRAM = r"""
import json, os, sys, tempfile
import torch
import torch.distributed as dist
from elasticstore.train import (ElasticDistributedSampler, ShardedStateError, SnapshotSettings,
                                Snapshots, heartbeat, save_checkpoint)

HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor")
out = {}
with tempfile.TemporaryDirectory() as tmp:
    node, ckpt = os.path.join(tmp, "node"), os.path.join(tmp, "ckpt")
    os.makedirs(node)
    snaps = Snapshots(settings=SnapshotSettings(node, 0), checkpoint_dir=ckpt, checkpoint_every=1)
    state = {"w": torch.ones(4), "step": 1}
    assert snaps.snapshot(state, 1)
    snaps.flush()
    save_checkpoint(os.path.join(tmp, "plain"), state, 1)
    out["plain"] = {m: m in sys.modules for m in HEAVY}

    # Now the code makes a DTensor (FSDP2 would): it imports the module first.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    sharded = {"w": distribute_tensor(torch.ones(4), mesh, [Shard(0)])}
    try:
        save_checkpoint(os.path.join(tmp, "refused"), sharded, 2)
        out["refused"] = False
    except ShardedStateError as e:
        out["refused"] = "'w'" in str(e)
    snaps.snapshot(sharded, 2)  # sharded state: DCP's layout, loaded now
    snaps.flush()
    out["sharded_snapshot"] = sorted(os.listdir(ckpt))
    out["after"] = {m: m in sys.modules for m in HEAVY}
    snaps.close()
    dist.destroy_process_group()
print(json.dumps(out))
"""


def test_replicated_state_needs_no_dcp_and_sharded_state_is_still_found() -> None:
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["plain"] == {"torch.distributed.checkpoint": False,
                            "torch.distributed.tensor": False}, out
    assert out["refused"] is True, out
    assert "dcp-step-000000000002" in out["sharded_snapshot"], out  # DCP checkpoint of step 2
    assert out["after"]["torch.distributed.checkpoint"], out
